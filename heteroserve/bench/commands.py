"""`heteroserve bench throughput|latency|serve|vision|embed|soak|quality|threads`: every command's flags.

The commands themselves (throughput_command.py, latency_command.py, serve_command.py, vision.py, embed.py, soak.py,
quality.py and thread_environment.py) import the engine and torch, so each is imported when it runs: building the
`heteroserve` parser (`--help`, `chat`, `gateway`) stays light and imports nothing of the engine.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from heteroserve.bench.peers import PEERS
from heteroserve.engine.engine_args import EngineArgs
from heteroserve.help_format import DefaultsHelpFormatter


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmark heteroserve against peers on the shared workload")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    _add_vision_parser(kinds)
    _add_embed_parser(kinds)
    _add_quality_parser(kinds)
    _add_threads_parser(kinds)
    soak = kinds.add_parser(
        "soak",
        formatter_class=DefaultsHelpFormatter,
        help="the gateway and several servers under mixed traffic and injected faults: what was lost",
    )
    soak.add_argument("model", nargs="?", default=None, help="served by every back end (default: the embedded one)")
    soak.add_argument("--duration", type=float, default=600, help="seconds of traffic")
    soak.add_argument("--servers", type=int, default=2, help="back ends behind the gateway")
    soak.add_argument("--concurrency", type=int, default=6, help="clients sending at once")
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--output-json", type=Path, default=None)
    soak.set_defaults(handler=_run_soak)
    for name, handler, summary in (
        ("throughput", _run_throughput, "requests of the workload all at once: output tokens/s (scenarios B, D)"),
        ("latency", _run_latency, "one request at a time: time to first token and decode tokens/s (scenario A)"),
        ("serve", _run_serve, "streaming clients against a real server: TTFT and inter-token latency (scenario C)"),
    ):
        sub = kinds.add_parser(name, formatter_class=DefaultsHelpFormatter, help=summary)
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


def _add_vision_parser(kinds: argparse._SubParsersAction) -> None:
    sub = kinds.add_parser(
        "vision",
        formatter_class=DefaultsHelpFormatter,
        help="one image + question through a vision-language model, ours vs transformers",
    )
    sub.add_argument("model", help="a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint folder")
    sub.add_argument("--image-size", type=int, default=448, help="side of the square test image, in pixels")
    sub.add_argument("--output-len", type=int, default=32)
    sub.add_argument("--repeats", type=int, default=3)
    sub.add_argument("--no-peer", action="store_true", help="skip transformers")
    sub.add_argument("--output-json", type=Path, default=None)
    EngineArgs.add_cli_args(sub)
    sub.set_defaults(handler=_run_vision)


def _add_embed_parser(kinds: argparse._SubParsersAction) -> None:
    sub = kinds.add_parser(
        "embed",
        formatter_class=DefaultsHelpFormatter,
        help="passages of mixed lengths through an embedding model, ours against sentence-transformers",
    )
    sub.add_argument("model", nargs="?", default=None, help="a sentence-transformers folder (default: built)")
    sub.add_argument("--passages", type=int, default=1000)
    sub.add_argument("--min-tokens", type=int, default=32)
    sub.add_argument("--max-tokens", type=int, default=512)
    sub.add_argument("--hidden-size", type=int, default=64, help="width of the built encoder")
    sub.add_argument("--layers", type=int, default=12, help="depth of the built encoder")
    sub.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    sub.add_argument("--rounds", type=int, default=3, help="alternating rounds of each side")
    sub.add_argument("--output-json", type=Path, default=None)
    EngineArgs.add_cli_args(sub)
    sub.set_defaults(handler=_run_embed)


def _add_quality_parser(kinds: argparse._SubParsersAction) -> None:
    sub = kinds.add_parser(
        "quality",
        formatter_class=DefaultsHelpFormatter,
        help="teacher-forced argmax agreement with float32 and perplexity of a narrower dtype on the workload",
    )
    sub.add_argument("model", nargs="?", default=None, help="default: the embedded model")
    sub.add_argument("--num-prompts", type=int, default=64)
    sub.add_argument("--input-len", type=int, default=128, help="prompt tokens (P)")
    sub.add_argument("--output-json", type=Path, default=None)
    EngineArgs.add_cli_args(sub)
    sub.set_defaults(handler=_run_quality, dtype="bfloat16")


def _add_threads_parser(kinds: argparse._SubParsersAction) -> None:
    sub = kinds.add_parser(
        "threads",
        formatter_class=DefaultsHelpFormatter,
        help="scenario A decode under each OMP_WAIT_POLICY and beside a second engine, alternating rounds",
    )
    sub.add_argument("--rounds", type=int, default=3)
    sub.add_argument("--repeats", type=int, default=3, help="generations per engine process (its median counts)")
    sub.add_argument("--output-len", type=int, default=128)
    sub.add_argument("--output-json", type=Path, default=None)
    sub.add_argument(
        "latency_args",
        nargs=argparse.REMAINDER,
        help="after --: the model and engine flags each `bench latency` process gets (e.g. -- --dtype float32)",
    )
    sub.set_defaults(handler=_run_threads)


def _run_vision(args: argparse.Namespace) -> None:
    from heteroserve.bench.vision import run_vision_bench

    run_vision_bench(args)


def _run_embed(args: argparse.Namespace) -> None:
    from heteroserve.bench.embed import run_embed_bench

    run_embed_bench(args)


def _run_quality(args: argparse.Namespace) -> None:
    from heteroserve.bench.quality import run_quality_bench

    run_quality_bench(args)


def _run_threads(args: argparse.Namespace) -> None:
    from heteroserve.bench.thread_environment import run_threads_bench

    run_threads_bench(args)


def _run_soak(args: argparse.Namespace) -> None:
    from heteroserve.bench.soak import run_soak_command

    run_soak_command(args)


def _run_throughput(args: argparse.Namespace) -> None:
    from heteroserve.bench.throughput_command import run_throughput_bench

    run_throughput_bench(args)


def _run_latency(args: argparse.Namespace) -> None:
    from heteroserve.bench.latency_command import run_latency_bench

    run_latency_bench(args)


def _run_serve(args: argparse.Namespace) -> None:
    from heteroserve.bench.serve_command import run_serve_bench

    run_serve_bench(args)
