"""Speculative decoding against llama.cpp's own, same run, alternating rounds: the default model in float32
drafted by its Q4_1 blocks, in our engine (`"model": "self-int4"`) and in llama-server (`-m` the F32 copy of the
file, `-md` the Q4_1 file as shipped).

Each round runs WORKLOAD.md's scenario A prompt (32 tokens, 128 generated, greedy, EOS ignored) through
`heteroserve bench latency` in its own process and through a llama-server started for the round (its
/completion endpoint, prompt cache off, `timings.predicted_per_second`), alternating which goes first. llama.cpp
drafts up to k tokens a step (`--spec-type draft-simple --spec-draft-n-min 0 --spec-draft-p-min 0`), so it
drafts whenever it can, as ours does.

    python bench/llama_cpp_speculative.py --llama-server /path/to/llama-server --rounds 3 --k 4 --out result.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from heteroserve.bench.peers.gguf_float import float_gguf
from heteroserve.bench.workload import scenario_requests
from heteroserve.model.loader import load_tokenizer
from heteroserve.model.loader.source import resolve_model

THREADS = 2
PORT = 8391


def ours(k: int, output_len: int, repeats: int) -> dict:
    spec = {"method": "draft_model", "model": "self-int4", "num_speculative_tokens": k}
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        command = [sys.executable, "-m", "heteroserve.entrypoints.cli", "bench", "latency", "--quantization", "none"]
        command += ["--output-len", str(output_len), "--repeats", str(repeats)]
        command += ["--speculative-config", json.dumps(spec), "--output-json", str(out)]
        subprocess.run(command, check=True, capture_output=True, text=True)
        result = json.loads(out.read_text())["heteroserve"]
    return {"decode_tokens_per_s": result["decode_tokens_per_s"], "acceptance": result["spec_acceptance_rate"]}


def llama_server(server: Path, target: Path, draft: Path, k: int, prompt: list[int], output_len: int, repeats: int):
    command = [str(server), "-m", str(target), "-md", str(draft), "--spec-type", "draft-simple"]
    command += ["--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]
    command += ["-t", str(THREADS), "-td", str(THREADS), "-c", "2048", "--port", str(PORT)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{PORT}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        rates, drafted, accepted = [], 0, 0
        for run in range(repeats + 1):
            body = {"prompt": prompt, "n_predict": output_len, "temperature": 0, "ignore_eos": True}
            timings = httpx.post(f"{url}/completion", json={**body, "cache_prompt": False}, timeout=600).json()
            timings = timings["timings"]
            if run:  # the first is a warm-up
                rates.append(timings["predicted_per_second"])
                drafted += timings.get("draft_n", 0)
                accepted += timings.get("draft_n_accepted", 0)
        return {
            "decode_tokens_per_s": statistics.median(rates),
            "acceptance": accepted / drafted if drafted else None,
        }
    finally:
        process.terminate()
        process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    source = resolve_model(None)
    draft = source.gguf_file
    target = float_gguf(draft, torch.float32)
    prompt_ids = scenario_requests(load_tokenizer(source).encode, "A", 1, 32, args.output_len)[0][0]
    rounds = []
    for index in range(args.rounds):
        sides = {
            "heteroserve": lambda: ours(args.k, args.output_len, args.repeats),
            "llama.cpp": lambda: llama_server(
                args.llama_server, target, draft, args.k, prompt_ids, args.output_len, args.repeats
            ),
        }
        order = list(sides) if index % 2 == 0 else list(reversed(sides))
        result = {side: sides[side]() for side in order}
        rounds.append(result)
        mine, theirs = result["heteroserve"], result["llama.cpp"]
        ratio = mine["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]
        print(
            f"round {index + 1} ({' then '.join(order)}): heteroserve {mine['decode_tokens_per_s']:.1f} tok/s "
            f"(acceptance {mine['acceptance']:.2f}), llama.cpp {theirs['decode_tokens_per_s']:.1f} tok/s "
            f"(acceptance {theirs['acceptance']}) -> {ratio:.2f}x",
            flush=True,
        )
    ratios = [r["heteroserve"]["decode_tokens_per_s"] / r["llama.cpp"]["decode_tokens_per_s"] for r in rounds]
    print(f"heteroserve / llama.cpp speculative decode: median {statistics.median(ratios):.2f}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        summary = {"k": args.k, "prompt_tokens": len(prompt_ids), "rounds": rounds, "decode_ratios": ratios}
        args.out.write_text(json.dumps({**summary, "median_decode_ratio": statistics.median(ratios)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
