"""`heteroserve bench latency`: one stream (scenario A) through our engine beside the peers, over one or more
alternating rounds."""

from __future__ import annotations

import statistics

from heteroserve.bench.engine_runs import single_stream
from heteroserve.bench.harness import (
    build_engine,
    engine_requests,
    median_round,
    runnable_peers,
    speculative_fields,
    write_report,
)


def _pooled_rounds(rounds: list[dict]) -> dict:
    """The round of median decode rate (the lower middle of an even count), with every round's figures."""
    picked = dict(median_round(rounds, key=lambda r: r["decode_tokens_per_s"]))
    picked["rounds_prefill_ms"] = [r["prefill_ms"] for r in rounds]
    picked["rounds_decode_tokens_per_s"] = [r["decode_tokens_per_s"] for r in rounds]
    return picked


def run_latency_bench(args) -> None:
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    engine = build_engine(args)
    prompt = engine_requests(engine, args, "A", 1)[0][0]
    result = {
        "command": "latency",
        "input_len": len(prompt),
        "output_len": args.output_len,
        "rounds": args.rounds,
        "peers": {},
        "_platform": engine.platform,
    }
    peers = list(runnable_peers(engine, args, result))
    ours_rounds: list[dict] = []
    peer_rounds: dict[str, list[dict]] = {name: [] for name, _ in peers}
    for index in range(args.rounds):
        prefix = f"round {index + 1}: " if args.rounds > 1 else ""
        ours_rounds.append(single_stream(engine, prompt, args.output_len, args.repeats))
        ours = ours_rounds[-1]
        print(
            f"{prefix}heteroserve: prefill {ours['prefill_ms']:.1f} ms, decode {ours['decode_tokens_per_s']:.1f} tok/s"
        )
        for name, peer in peers:
            theirs = peer.single_stream(prompt, args.output_len, args.repeats)
            peer_rounds[name].append(theirs)
            print(
                f"{prefix}{name}: prefill {theirs['prefill_ms']:.1f} ms, decode "
                f"{theirs['decode_tokens_per_s']:.1f} tok/s -> heteroserve decode "
                f"{ours['decode_tokens_per_s'] / theirs['decode_tokens_per_s']:.2f}x, prefill "
                f"{theirs['prefill_ms'] / ours['prefill_ms']:.2f}x faster"
            )
    ours = _pooled_rounds(ours_rounds)
    result["latency_samples_ms"] = {"heteroserve inter-token": ours.pop("inter_token_samples_ms")}
    ours["quantization"] = engine.config.model.quantization or "as checkpoint"
    ours["kv_cache_dtype"] = str(engine.model.kv_cache_dtype).removeprefix("torch.")
    ours["weight_bytes"] = engine.model.weight_bytes
    ours.update(speculative_fields(engine))
    result["heteroserve"] = ours
    for name, peer in peers:
        rounds = peer_rounds[name]
        theirs = _pooled_rounds(rounds)
        # Each ratio is the median of the rounds' adjacent pairs.
        theirs["rounds_decode_ratio"] = [
            o["decode_tokens_per_s"] / t["decode_tokens_per_s"] for o, t in zip(ours_rounds, rounds, strict=True)
        ]
        theirs["rounds_prefill_ratio"] = [
            t["prefill_ms"] / o["prefill_ms"] for o, t in zip(ours_rounds, rounds, strict=True)
        ]
        theirs["decode_ratio"] = statistics.median(theirs["rounds_decode_ratio"])
        theirs["prefill_ratio"] = statistics.median(theirs["rounds_prefill_ratio"])
        theirs["weights"] = peer.weights
        result["peers"][name] = theirs
        if args.rounds > 1:
            print(
                f"{name}: heteroserve decode {theirs['decode_ratio']:.2f}x, prefill {theirs['prefill_ratio']:.2f}x "
                "faster (medians of the rounds)"
            )
    write_report(args, result)
