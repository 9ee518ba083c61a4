"""Decode with recorded graphs against the same engine with --enforce-eager, on a device that has graphs (CUDA).

Both engines are loaded once in this process on the device; each round runs every batch size on each, alternating
which goes first. A run is `LLM.generate` of `batch` requests (the workload's 16-token prompts, greedy, EOS
ignored, --max-tokens new tokens each); output tokens over wall time, prefill included (16 tokens a request against
128 decoded). The ratio per batch size is the median of the rounds' graphs/eager ratios. Greedy tokens of the two
engines are compared for every run.

    python bench/decode_graphs.py --rounds 3 --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from heteroserve import LLM, SamplingParams
from heteroserve.bench.workload import prompt_ids


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.engine.runner.platform.synchronize()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.runner.platform.synchronize()
    seconds = time.perf_counter() - start
    return len(prompts) * max_tokens / seconds, [list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--quantization", default=None, help="as LLM(quantization=...): unset is the 4-bit file")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    settings = {
        "quantization": args.quantization,
        "max_model_len": 512,
        "max_num_seqs": max(args.batches),
        "kv_cache_memory_bytes": 2**30,  # both engines on one device: a fixed share each
    }
    engines = {"graphs": LLM(**settings), "eager": LLM(**settings, enforce_eager=True)}
    tokenizer = engines["eager"].get_tokenizer()
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompts = [prompt_ids(encode, i, 16) for i in range(max(args.batches))]
    for llm in engines.values():  # a first run of each size: graphs are recorded when first needed
        for batch in args.batches:
            run(llm, prompts[:batch], 8)
    rates: dict[int, dict[str, list[float]]] = {b: {"graphs": [], "eager": []} for b in args.batches}
    mismatches = 0
    for r in range(args.rounds):
        order = ["graphs", "eager"] if r % 2 == 0 else ["eager", "graphs"]
        for batch in args.batches:
            tokens = {}
            for name in order:
                rate, tokens[name] = run(engines[name], prompts[:batch], args.max_tokens)
                rates[batch][name].append(rate)
            mismatches += sum(a != b for a, b in zip(tokens["graphs"], tokens["eager"], strict=True))
    print("| batch | graphs tok/s (median) | eager tok/s (median) | graphs / eager (median of rounds) |")
    print("|---|---|---|---|")
    report = {"rounds": args.rounds, "max_tokens": args.max_tokens, "quantization": args.quantization, "batches": {}}
    for batch, both in rates.items():
        ratio = statistics.median(g / e for g, e in zip(both["graphs"], both["eager"], strict=True))
        print(
            f"| {batch} | {statistics.median(both['graphs']):.0f} | {statistics.median(both['eager']):.0f} | "
            f"{ratio:.2f}x |"
        )
        report["batches"][batch] = {**both, "ratio": ratio}
    print(f"requests whose greedy tokens differ between the engines: {mismatches}")
    report["token_mismatches"] = mismatches
    replayed = engines["graphs"].engine.runner.graphs
    report["recorded"] = sorted(replayed.recorded) if replayed is not None else []
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
