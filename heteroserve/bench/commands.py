"""`heteroserve bench throughput|latency|serve|vision|embed|soak|quality|threads`: the parser (the commands are
in throughput_command.py, latency_command.py, serve_command.py, vision.py, embed.py, soak.py, quality.py and
thread_environment.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from heteroserve.bench.embed import add_embed_parser
from heteroserve.bench.harness import PEERS
from heteroserve.bench.latency_command import run_latency_bench
from heteroserve.bench.quality import add_quality_parser
from heteroserve.bench.serve_command import run_serve_bench
from heteroserve.bench.soak import run_soak_command
from heteroserve.bench.thread_environment import add_threads_parser
from heteroserve.bench.throughput_command import run_throughput_bench
from heteroserve.bench.vision import add_vision_parser
from heteroserve.engine.engine_args import EngineArgs


def add_bench_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmark heteroserve against peers on the shared workload")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    add_vision_parser(kinds)
    add_embed_parser(kinds)
    add_quality_parser(kinds)
    add_threads_parser(kinds)
    soak = kinds.add_parser(
        "soak",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="the gateway and several servers under mixed traffic and injected faults: what was lost",
    )
    soak.add_argument("model", nargs="?", default=None, help="served by every back end (default: the embedded one)")
    soak.add_argument("--duration", type=float, default=600, help="seconds of traffic")
    soak.add_argument("--servers", type=int, default=2, help="back ends behind the gateway")
    soak.add_argument("--concurrency", type=int, default=6, help="clients sending at once")
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--output-json", type=Path, default=None)
    soak.set_defaults(handler=run_soak_command)
    for name, handler in (
        ("throughput", run_throughput_bench),
        ("latency", run_latency_bench),
        ("serve", run_serve_bench),
    ):
        sub = kinds.add_parser(name, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        sub.add_argument("model", nargs="?", default=None)
        sub.add_argument("--peer", action="append", default=[], help=f"also run a peer: {', '.join(PEERS)}")
        sub.add_argument("--output-json", type=Path, default=None)
        sub.add_argument("--plot", type=Path, default=None, help="write a PNG chart of the results")
        sub.add_argument(
            "--dataset", default="workload", help="workload (WORKLOAD.md prompts), random, or a JSONL file of prompts"
        )
        EngineArgs.add_cli_args(sub)
        sub.set_defaults(handler=handler)
        if name == "throughput":
            sub.add_argument("--scenario", choices=["B", "D"], default="B")
            sub.add_argument("--num-requests", type=int, default=64)
            sub.add_argument("--input-len", type=int, default=128)
            sub.add_argument("--output-len", type=int, default=128)
            sub.add_argument("--hf-batch", default="1,8,64", help="transformers static batch sizes to run")
            sub.add_argument(
                "--structured",
                choices=["json-schema"],
                default=None,
                help="run the batch plain and with a JSON schema per request (structured outputs), alternating: "
                "the grammar's cost",
            )
            sub.add_argument(
                "--lora-adapters",
                type=int,
                default=None,
                metavar="N",
                help="run the batch on the base model alone and with N random adapters (--lora-rank) spread over "
                "the requests, alternating: the cost of multi-LoRA serving (sets --enable-lora, --max-loras N)",
            )
            sub.add_argument("--lora-rank", type=int, default=16, help="rank of --lora-adapters' adapters")
            sub.add_argument(
                "--hf-requests",
                type=int,
                default=None,
                help="run the one-at-a-time baselines (transformers, llama.cpp) on this many requests and scale "
                "(their cost is linear)",
            )
            sub.add_argument(
                "--rounds",
                type=int,
                default=1,
                help="run heteroserve and every peer configuration this many times, alternating; each ratio is "
                "the median of the rounds' adjacent pairs, since this machine's pace drifts from minute to minute",
            )
        elif name == "latency":
            sub.add_argument("--input-len", type=int, default=32)
            sub.add_argument("--output-len", type=int, default=128)
            sub.add_argument("--repeats", type=int, default=3)
            sub.add_argument(
                "--rounds",
                type=int,
                default=1,
                help="run heteroserve's repeats and every peer's this many times, alternating; each ratio is the "
                "median of the rounds' pairs",
            )
        else:
            sub.add_argument("--base-url", default=None, help="server to measure (default: start our own)")
            sub.add_argument("--served-model", default=None, help="model name to send (default: none)")
            sub.add_argument("--api-key", default=None)
            sub.add_argument("--concurrency", type=int, default=16)
            sub.add_argument("--num-requests", type=int, default=16)
            sub.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
            sub.add_argument("--input-len", type=int, default=128)
            sub.add_argument("--output-len", type=int, default=64)
            sub.add_argument(
                "--gateway",
                action="store_true",
                help="also measure the same server through `heteroserve gateway` (prefix caching off)",
            )
            sub.add_argument(
                "--compare-offline",
                action=argparse.BooleanOptionalAction,
                default=None,
                help="also run the requests in-process (default: on when starting our own server)",
            )
            sub.add_argument(
                "--rounds",
                type=int,
                default=1,
                help="measure the concurrent requests this many times on each side of --compare-offline and "
                "--gateway, alternating, each later round on prompts of its own; each ratio is the median of the "
                "rounds' pairs",
            )
            sub.add_argument(
                "--ttft-requests",
                type=int,
                default=20,
                help="requests at concurrency 1 for the server-vs-offline TTFT comparison",
            )
            sub.add_argument(
                "--ttft-rounds",
                type=int,
                default=1,
                help="split that comparison over this many fresh server and offline-engine processes (our own "
                "server only): the same prefill runs up to ~13 ms faster or slower from one process to the next",
            )
