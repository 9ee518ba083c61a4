"""Batch-1 decode with and without a draft model, alternating rounds: what draft-model speculation buys.

Each round runs `heteroserve bench latency` (WORKLOAD.md's scenario A: one greedy request, 128 generated tokens)
twice, each in its own process, alternating which goes first: once plain, once with `--speculative-config`
(by default the served checkpoint's own 4-bit copy, `"model": "self-int4"`). The served model is the default one
dequantised (`--quantization none`, float32 unless `--dtype` says otherwise), where a 4-bit draft reads a
seventh of the target's bytes. The ratio is the median of the rounds' speculative / plain decode rates; the
drafts' acceptance rate comes from the engine's own counters.

    python bench/draft_speculation.py --rounds 5 --num-speculative-tokens 4 --out result.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def latency(extra: list[str], output_len: int, repeats: int) -> dict:
    """`bench latency`'s figures for our engine (decode rate, prefill, speculative counters)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        command = [sys.executable, "-m", "heteroserve.entrypoints.cli", "bench", "latency"]
        command += ["--quantization", "none", "--output-len", str(output_len), "--repeats", str(repeats)]
        subprocess.run([*command, *extra, "--output-json", str(out)], check=True, capture_output=True, text=True)
        return json.loads(out.read_text())["heteroserve"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--draft", default="self-int4", help='the draft checkpoint, or "self-int4"')
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.num_speculative_tokens}
    sides = {
        "plain": ["--dtype", args.dtype],
        "speculative": ["--dtype", args.dtype, "--speculative-config", json.dumps(spec)],
    }
    rounds: list[dict[str, dict]] = []
    for index in range(args.rounds):
        order = list(sides) if index % 2 == 0 else list(reversed(sides))
        results = {side: latency(sides[side], args.output_len, args.repeats) for side in order}
        rounds.append(results)
        plain, fast = results["plain"], results["speculative"]
        print(
            f"round {index + 1} ({' then '.join(order)}): plain {plain['decode_tokens_per_s']:.1f} tok/s, "
            f"speculative {fast['decode_tokens_per_s']:.1f} tok/s -> "
            f"{fast['decode_tokens_per_s'] / plain['decode_tokens_per_s']:.2f}x, "
            f"acceptance {fast['spec_acceptance_rate']:.3f}",
            flush=True,
        )
    ratios = [r["speculative"]["decode_tokens_per_s"] / r["plain"]["decode_tokens_per_s"] for r in rounds]
    print(f"speculative / plain decode: median {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
    if args.out:
        summary = {
            "speculative_config": spec,
            "dtype": args.dtype,
            "output_len": args.output_len,
            "rounds": [
                {side: {k: v for k, v in result.items() if k != "inter_token_ms"} for side, result in r.items()}
                for r in rounds
            ],
            "decode_ratios": ratios,
            "median_decode_ratio": statistics.median(ratios),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
