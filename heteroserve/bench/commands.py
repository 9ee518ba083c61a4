"""`heteroserve bench throughput|latency|serve`: the parser, and our engine beside the transformers peer on the
same prompts (the serve command is in serve_command.py)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from heteroserve.bench.engine_runs import run_batch, single_stream
from heteroserve.bench.harness import PEERS, build_engine, engine_requests, write_report
from heteroserve.bench.serve_command import run_serve_bench
from heteroserve.bench.vision import add_vision_parser
from heteroserve.bench.workload import fingerprint
from heteroserve.engine.llm_engine import LLMEngine
from heteroserve.entrypoints.engine_args import add_engine_args


def add_bench_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmark heteroserve against peers on the shared workload")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    add_vision_parser(kinds)
    for name, handler in (("throughput", _throughput), ("latency", _latency), ("serve", run_serve_bench)):
        sub = kinds.add_parser(name, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        sub.add_argument("model", nargs="?", default=None)
        sub.add_argument("--peer", action="append", default=[], help=f"also run a peer: {', '.join(PEERS)}")
        sub.add_argument("--output-json", type=Path, default=None)
        sub.add_argument("--plot", type=Path, default=None, help="write a PNG chart of the results")
        sub.add_argument(
            "--dataset", default="workload", help="workload (WORKLOAD.md prompts), random, or a JSONL file of prompts"
        )
        add_engine_args(sub)
        sub.set_defaults(handler=handler)
        if name == "throughput":
            sub.add_argument("--scenario", choices=["B", "D"], default="B")
            sub.add_argument("--num-requests", type=int, default=64)
            sub.add_argument("--input-len", type=int, default=128)
            sub.add_argument("--output-len", type=int, default=128)
            sub.add_argument("--hf-batch", default="1,8,64", help="transformers static batch sizes to run")
            sub.add_argument(
                "--hf-requests",
                type=int,
                default=None,
                help="run the one-at-a-time baselines (transformers, llama.cpp) on this many requests and scale "
                "(their cost is linear)",
            )
        elif name == "latency":
            sub.add_argument("--input-len", type=int, default=32)
            sub.add_argument("--output-len", type=int, default=128)
            sub.add_argument("--repeats", type=int, default=3)
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


def _peers(engine: LLMEngine, args, result: dict):
    """(name, peer) for each --peer that can run here; one that cannot is recorded as skipped, with why."""
    from heteroserve.model.loader.source import resolve_model

    source = resolve_model(engine.config.model.model)
    for name in args.peer:
        if name == "hf":
            from heteroserve.bench.hf_peer import HFPeer

            yield name, HFPeer(source, engine.dtype)
            continue
        from heteroserve.bench.llama_cpp_peer import LlamaCppPeer, llama_cpp_missing

        missing = llama_cpp_missing()
        if missing is not None:
            print(f"skipping the llama-cpp peer: {missing}")
            result["peers"][name] = {"skipped": missing}
            continue
        yield name, LlamaCppPeer(source, engine.max_model_len)


def _speculative_fields(engine: LLMEngine) -> dict:
    """The speculative decoding configuration (None when off) and how many drafts the model confirmed."""
    config = engine.config.speculative
    stats = engine.stats()
    drafts, accepted = stats.spec_draft_tokens, stats.spec_accepted_tokens
    return {
        "speculative": dataclasses.asdict(config) if config is not None else None,
        "spec_draft_tokens": drafts,
        "spec_accepted_tokens": accepted,
        "spec_acceptance_rate": accepted / drafts if drafts else None,
    }


def _match_rate(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Fraction of requests whose greedy tokens equal the peer's exactly."""
    return sum(a == b for a, b in zip(ours, theirs, strict=False)) / max(len(theirs), 1)


def _throughput(args) -> None:
    engine = build_engine(args)
    requests = engine_requests(engine, args, args.scenario, args.num_requests)
    run = run_batch(engine, requests)
    result = {
        "command": "throughput",
        "scenario": args.scenario,
        "num_requests": len(requests),
        "prompt_fingerprint": fingerprint([p for p, _ in requests]),
        "heteroserve": {
            "wall_s": run.wall_s,
            "requests_per_s": len(requests) / run.wall_s,
            "output_tokens": run.output_tokens,
            "output_tokens_per_s": run.output_tokens / run.wall_s,
            "total_tokens_per_s": (run.output_tokens + run.prompt_tokens) / run.wall_s,
            "peak_kv_blocks": run.peak_kv_blocks,
            "kv_blocks_needed": run.kv_blocks_needed,
            "kv_blocks_allocated": run.kv_blocks_allocated,
            "peak_rss_mib": run.peak_rss_mib,
            "steps": run.num_steps,
            "preemptions": run.num_preemptions,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(engine.kv_cache_dtype).removeprefix("torch."),
            "quantization": engine.config.model.quantization or "as checkpoint",
            "weight_bytes": engine.weight_bytes,
            **_speculative_fields(engine),
        },
        "peers": {},
        "latency_samples_ms": {"heteroserve request e2e": [1000 * x for x in run.e2e_s]},
        "_platform": engine.platform,
    }
    print(
        f"heteroserve: {run.wall_s:.1f} s, {run.output_tokens / run.wall_s:.1f} output tok/s, "
        f"peak KV blocks {run.peak_kv_blocks} (needed {run.kv_blocks_needed}, allocated {run.kv_blocks_allocated})"
    )
    for name, peer in _peers(engine, args, result):
        batches = [int(b) for b in args.hf_batch.split(",") if b] if name == "hf" else [1]
        for batch in batches:
            subset = requests[: args.hf_requests] if batch == 1 and args.hf_requests else requests
            peer_run = peer.run_batches(subset, batch)
            scale = len(requests) / len(subset)
            tps = peer_run.output_tokens / peer_run.wall_s
            label = f"{name}_static_{batch}" if batch > 1 else f"{name}_one_at_a_time"
            match = _match_rate(run.outputs[: len(subset)], peer_run.outputs)
            result["peers"][label] = {
                "wall_s": peer_run.wall_s * scale,
                "measured_requests": len(subset),
                "scaled": scale != 1,
                "output_tokens_per_s": tps,
                "heteroserve_ratio": (run.output_tokens / run.wall_s) / tps,
                "greedy_match_rate": match,
                "weights": peer.weights,
            }
            note = f" (measured on {len(subset)} requests, scaled)" if scale != 1 else ""
            print(
                f"{label}: {peer_run.wall_s * scale:.1f} s{note}, {tps:.1f} output tok/s -> heteroserve is "
                f"{result['peers'][label]['heteroserve_ratio']:.2f}x; identical greedy outputs {match:.0%}"
            )
    write_report(args, result)


def _latency(args) -> None:
    engine = build_engine(args)
    prompt = engine_requests(engine, args, "A", 1)[0][0]
    ours = single_stream(engine, prompt, args.output_len, args.repeats)
    samples = ours.pop("inter_token_samples_ms")
    ours["quantization"] = engine.config.model.quantization or "as checkpoint"
    ours["kv_cache_dtype"] = str(engine.kv_cache_dtype).removeprefix("torch.")
    ours["weight_bytes"] = engine.weight_bytes
    ours.update(_speculative_fields(engine))
    result = {
        "command": "latency",
        "input_len": len(prompt),
        "output_len": args.output_len,
        "heteroserve": ours,
        "peers": {},
        "latency_samples_ms": {"heteroserve inter-token": samples},
        "_platform": engine.platform,
    }
    print(f"heteroserve: prefill {ours['prefill_ms']:.1f} ms, decode {ours['decode_tokens_per_s']:.1f} tok/s")
    for name, peer in _peers(engine, args, result):
        theirs = peer.single_stream(prompt, args.output_len, args.repeats)
        theirs["decode_ratio"] = ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]
        theirs["prefill_ratio"] = theirs["prefill_ms"] / ours["prefill_ms"]
        theirs["weights"] = peer.weights
        result["peers"][name] = theirs
        print(
            f"{name}: prefill {theirs['prefill_ms']:.1f} ms, decode {theirs['decode_tokens_per_s']:.1f} tok/s -> "
            f"heteroserve decode {theirs['decode_ratio']:.2f}x, prefill {theirs['prefill_ratio']:.2f}x faster"
        )
    write_report(args, result)
