"""Scenarios A, B and C of the default model as shipped on two checkouts, alternating rounds: is a change free?

Each round runs `heteroserve bench latency` (A: one request, 128 prompt and 128 generated tokens), `bench
throughput --scenario B` (64 requests at once) and `bench serve` (C: 16 streaming clients against a server), one
round each, first on one checkout then on the other, the order swapped every round; the ratios are the medians of
the rounds' after/before ratios. Each checkout runs from its own tree (PYTHONPATH), with this interpreter.

    git worktree add --detach /tmp/before <commit>
    python bench/compare_commits.py --before /tmp/before --after . --rounds 3 --out comparison.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SCENARIOS = {
    "A": (["latency", "--rounds", "1"], [("decode tok/s", "decode_tokens_per_s"), ("prefill ms", "prefill_ms")]),
    "B": (["throughput", "--scenario", "B", "--rounds", "1"], [("output tok/s", "output_tokens_per_s")]),
    "C": (
        ["serve", "--concurrency", "16", "--num-requests", "16", "--input-len", "128", "--output-len", "64"]
        + ["--rounds", "1", "--no-compare-offline"],
        [("output tok/s", "output_tokens_per_s"), ("TTFT p50 ms", ("ttft_ms", "p50"))],
    ),
}


def run(tree: Path, scenario: str) -> dict:
    arguments, _ = SCENARIOS[scenario]
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        command = [sys.executable, "-m", "heteroserve.entrypoints.cli", "bench", *arguments, "--output-json", str(out)]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{tree}: bench {scenario} failed:\n{result.stderr[-3000:]}")
        return json.loads(out.read_text())["heteroserve"]


def value(result: dict, key: str | tuple[str, str]) -> float:
    return result[key[0]][key[1]] if isinstance(key, tuple) else result[key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    results: dict[str, dict[str, list[dict]]] = {s: {"before": [], "after": []} for s in args.scenarios}
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for scenario in args.scenarios:
            for side in order:
                results[scenario][side].append(run(trees[side], scenario))
                print(f"round {r} {scenario} {side} done", flush=True)
    print("| scenario | figure | before (median) | after (median) | after / before (median of rounds) |")
    print("|---|---|---|---|---|")
    report = {"trees": {k: str(v) for k, v in trees.items()}, "rounds": args.rounds, "scenarios": {}}
    for scenario in args.scenarios:
        for label, key in SCENARIOS[scenario][1]:
            before = [value(x, key) for x in results[scenario]["before"]]
            after = [value(x, key) for x in results[scenario]["after"]]
            ratio = statistics.median(a / b for a, b in zip(after, before, strict=True))
            print(
                f"| {scenario} | {label} | {statistics.median(before):.1f} | {statistics.median(after):.1f} | "
                f"{ratio:.3f} |"
            )
            report["scenarios"][f"{scenario} {label}"] = {"before": before, "after": after, "ratio": ratio}
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
