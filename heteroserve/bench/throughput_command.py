"""`heteroserve bench throughput`: a batch of requests at once through our engine, beside the peers' static
batches on the same prompts, over one or more alternating rounds."""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from heteroserve.bench.engine_runs import BatchRun, run_batch, structured_schema
from heteroserve.bench.harness import (
    build_engine,
    engine_requests,
    median_round,
    runnable_peers,
    speculative_fields,
    write_report,
)
from heteroserve.bench.workload import fingerprint
from heteroserve.engine.llm_engine import LLMEngine


def run_throughput_bench(args) -> None:
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    engine = build_engine(args)
    requests = engine_requests(engine, args, args.scenario, args.num_requests)
    result = {
        "command": "throughput",
        "scenario": args.scenario,
        "num_requests": len(requests),
        "prompt_fingerprint": fingerprint([p for p, _ in requests]),
        "rounds": args.rounds,
        "peers": {},
        "_platform": engine.platform,
    }
    if args.structured is not None or args.lora_adapters:
        if args.peer:
            raise SystemExit("--structured and --lora-adapters compare our engine with itself: run them without --peer")
        if args.structured is not None:
            _structured_rounds(engine, requests, args, result)
        else:
            _lora_rounds(engine, requests, args, result)
        return
    peers = list(runnable_peers(engine, args, result))
    runs: list[BatchRun] = []
    peer_rounds: dict[str, list[dict]] = {}
    for round_index in range(args.rounds):
        engine.scheduler.kv_cache.reset_cache()  # a round must not reuse the previous one's cached prompts
        run = run_batch(engine, requests)
        runs.append(run)
        prefix = f"round {round_index + 1}: " if args.rounds > 1 else ""
        print(
            f"{prefix}heteroserve: {run.wall_s:.1f} s, {run.output_tokens / run.wall_s:.1f} output tok/s, peak KV "
            f"blocks {run.peak_kv_blocks} (needed {run.kv_blocks_needed}, allocated {run.kv_blocks_allocated})"
        )
        for name, peer in peers:
            for label, measured in _peer_configurations(name, peer, args, requests, run):
                peer_rounds.setdefault(label, []).append(measured)
                print(f"{prefix}{label}: {_describe(measured)}")
    run = median_round(runs, key=lambda r: r.wall_s)
    result["heteroserve"] = _batch_fields(engine, run, runs)
    result["latency_samples_ms"] = {"heteroserve request e2e": [1000 * x for x in run.e2e_s]}
    for label, measured in peer_rounds.items():
        result["peers"][label] = _pooled_rounds(measured)
        if args.rounds > 1:
            print(f"{label}: heteroserve is {result['peers'][label]['heteroserve_ratio']:.2f}x (median of rounds)")
    write_report(args, result)


def _paired_rounds(
    engine: LLMEngine, requests, rounds: int, variant: tuple[str, Callable[[], BatchRun]], base_label: str
) -> tuple[list[BatchRun], list[BatchRun], list[float]]:
    """The plain batch and a variant of it, alternating which goes first each round: (plain runs, variant runs,
    each round's variant / plain throughput)."""
    label, run_variant = variant
    plain_runs: list[BatchRun] = []
    variant_runs: list[BatchRun] = []
    for round_index in range(rounds):
        for is_variant in [False, True] if round_index % 2 == 0 else [True, False]:
            engine.scheduler.kv_cache.reset_cache()  # a run must not reuse the previous one's cached prompts
            run = run_variant() if is_variant else run_batch(engine, requests)
            (variant_runs if is_variant else plain_runs).append(run)
            tokens_per_s = run.output_tokens / run.wall_s
            print(
                f"round {round_index + 1}: {label if is_variant else base_label}: {run.wall_s:.1f} s, "
                f"{tokens_per_s:.1f} output tok/s"
            )
    ratios = [
        (v.output_tokens / v.wall_s) / (p.output_tokens / p.wall_s)
        for p, v in zip(plain_runs, variant_runs, strict=True)
    ]
    return plain_runs, variant_runs, ratios


def _structured_rounds(engine: LLMEngine, requests, args, result: dict) -> None:
    """The same batch plain and with a JSON schema per request; the cost of the grammar is the median of the
    rounds' throughput ratios."""
    variant = ("json schema", lambda: run_batch(engine, requests, structured_schema))
    plain_runs, structured_runs, ratios = _paired_rounds(engine, requests, args.rounds, variant, "plain")
    plain = median_round(plain_runs, key=lambda r: r.wall_s)
    structured = median_round(structured_runs, key=lambda r: r.wall_s)
    result["heteroserve"] = _batch_fields(engine, plain, plain_runs)
    result["structured"] = {
        "constraint": args.structured,
        **_batch_fields(engine, structured, structured_runs),
        "throughput_vs_plain": statistics.median(ratios),
        "rounds_throughput_vs_plain": ratios,
    }
    result["latency_samples_ms"] = {"heteroserve request e2e": [1000 * x for x in plain.e2e_s]}
    print(f"json schema per request: {statistics.median(ratios):.1%} of plain throughput (median of rounds)")
    write_report(args, result)


def _lora_rounds(engine: LLMEngine, requests, args, result: dict) -> None:
    """The batch on the base model alone and with request i under adapter i mod N; the cost of the adapters is the
    median of the rounds' throughput ratios."""
    from heteroserve.bench.lora_adapters import write_random_adapters
    from heteroserve.model.arch import ModelArch

    with tempfile.TemporaryDirectory(prefix="heteroserve-bench-lora-") as folder:
        arch = ModelArch.from_hf_config(engine.model.hf_config)
        adapters = write_random_adapters(arch, Path(folder), args.lora_adapters, args.lora_rank, args.seed)
        label = f"{len(adapters)} adapters of rank {args.lora_rank}"
        variant = (label, lambda: run_batch(engine, requests, lora=lambda i: adapters[i % len(adapters)]))
        base_runs, lora_runs, ratios = _paired_rounds(engine, requests, args.rounds, variant, "base model alone")
    base = median_round(base_runs, key=lambda r: r.wall_s)
    with_adapters = median_round(lora_runs, key=lambda r: r.wall_s)
    result["heteroserve"] = _batch_fields(engine, base, base_runs)
    result["lora"] = {
        "adapters": len(adapters),
        "rank": args.lora_rank,
        "max_loras": engine.config.lora.max_loras,
        **_batch_fields(engine, with_adapters, lora_runs),
        "throughput_vs_base": statistics.median(ratios),
        "rounds_throughput_vs_base": ratios,
    }
    result["latency_samples_ms"] = {"heteroserve request e2e": [1000 * x for x in base.e2e_s]}
    print(f"{label}: {statistics.median(ratios):.1%} of the base model's throughput (median of rounds)")
    write_report(args, result)


def _peer_configurations(name: str, peer, args, requests, run: BatchRun):
    """(label, figures) of each configuration of one peer, run right after our own run of this round."""
    for label, batch in _configurations(name, args, len(requests)):
        subset = requests[: args.hf_requests] if batch == 1 and args.hf_requests else requests
        peer_run = peer.run_batches(subset, batch)
        scale = len(requests) / len(subset)
        tps = peer_run.output_tokens / peer_run.wall_s
        yield (
            label,
            {
                "wall_s": peer_run.wall_s * scale,
                "measured_requests": len(subset),
                "scaled": scale != 1,
                "output_tokens_per_s": tps,
                "heteroserve_ratio": (run.output_tokens / run.wall_s) / tps,
                "greedy_match_rate": _match_rate(run.outputs[: len(subset)], peer_run.outputs),
                "weights": peer.weights,
            },
        )


def _configurations(name: str, args, num_requests: int) -> list[tuple[str, int]]:
    """(label, requests submitted at a time) of each way one peer runs the batch: transformers' static batches of
    --hf-batch, vLLM's continuous batching over every request at once as ours, llama.cpp one at a time."""
    if name == "vllm":
        return [(f"{name}_all_at_once", num_requests)]
    batches = [int(b) for b in args.hf_batch.split(",") if b] if name == "hf" else [1]
    return [(f"{name}_static_{batch}" if batch > 1 else f"{name}_one_at_a_time", batch) for batch in batches]


def _describe(measured: dict) -> str:
    note = f" (measured on {measured['measured_requests']} requests, scaled)" if measured["scaled"] else ""
    return (
        f"{measured['wall_s']:.1f} s{note}, {measured['output_tokens_per_s']:.1f} output tok/s -> heteroserve is "
        f"{measured['heteroserve_ratio']:.2f}x; identical greedy outputs {measured['greedy_match_rate']:.0%}"
    )


def _pooled_rounds(rounds: list[dict]) -> dict:
    """One peer configuration over the rounds: medians, each round's wall time and ratio, the worst match rate."""
    return {
        **rounds[0],
        "wall_s": statistics.median(r["wall_s"] for r in rounds),
        "output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in rounds),
        "heteroserve_ratio": statistics.median(r["heteroserve_ratio"] for r in rounds),
        "greedy_match_rate": min(r["greedy_match_rate"] for r in rounds),
        "rounds_wall_s": [r["wall_s"] for r in rounds],
        "rounds_heteroserve_ratio": [r["heteroserve_ratio"] for r in rounds],
    }


def _batch_fields(engine: LLMEngine, run: BatchRun, runs: list[BatchRun]) -> dict:
    """Our figures from `run`, the round of median wall time, with every round's wall time and cache hits."""
    tokens = run.output_tokens + run.prompt_tokens
    return {
        "wall_s": run.wall_s,
        "rounds_wall_s": [r.wall_s for r in runs],
        "requests_per_s": len(run.outputs) / run.wall_s,
        "output_tokens": run.output_tokens,
        "output_tokens_per_s": run.output_tokens / run.wall_s,
        "total_tokens_per_s": tokens / run.wall_s,
        "peak_kv_blocks": run.peak_kv_blocks,
        "kv_blocks_needed": run.kv_blocks_needed,
        "kv_blocks_allocated": run.kv_blocks_allocated,
        "peak_rss_mib": run.peak_rss_mib,
        "steps": run.num_steps,
        "preemptions": run.num_preemptions,
        "rounds_prefix_cache_hit_tokens": [r.prefix_cache_hit_tokens for r in runs],
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(engine.model.kv_cache_dtype).removeprefix("torch."),
        "quantization": engine.config.model.quantization or "as checkpoint",
        "weight_bytes": engine.model.weight_bytes,
        **speculative_fields(engine),
    }


def _match_rate(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Fraction of requests whose greedy tokens equal the peer's exactly."""
    return sum(a == b for a, b in zip(ours, theirs, strict=False)) / max(len(theirs), 1)
