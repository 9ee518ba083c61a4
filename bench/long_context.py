"""Scenario L, long contexts, against llama.cpp's server on the same GGUF, same run, alternating rounds.

Each round starts each server in turn (alternating which goes first), warms it up with a short request, then
streams WORKLOAD.md-style prompts through `/v1/completions` (token ids, greedy, EOS ignored, 256 generated):
phase 1, four requests of 6,000 prompt tokens at once; phase 2, one request of 7,900 alone. Reported per phase:
time to first token (each request's), decode rate at depth, and the server's peak resident memory (VmHWM) after
both phases. Both servers hold the KV cache in 16 bits (llama.cpp's default f16; ours `--kv-cache-dtype float16`),
the same size on both (4 x 8,192 tokens); prefix caching is off on both (every prompt is new anyway). Decode at
depth is the phase's tokens over the stretch in which all its requests are past their prompts and none has
finished.

The fraction of the machine's read rate that decode attention reaches at depth: a decode step of phase 1 reads
every request's K and V (layers x 2 x kv_heads x head_dim x 2 bytes a token of context) and the weights once;
bytes / step time, against --read-rate-gbs (this machine's streaming read rate, measured apart).

    python bench/long_context.py --llama-server /path/to/llama-server --rounds 2 --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from gguf import GGUFReader

from heteroserve.bench.workload import SENTENCES
from heteroserve.model.loader import load_tokenizer
from heteroserve.model.loader.source import resolve_model

THREADS = 2
PORT = 8392
OUTPUT = 256
PHASES = {"four_of_6000": [6000] * 4, "one_of_7900": [7900]}
CONTEXT = 8192


def long_prompt(encode, i: int, length: int) -> list[int]:
    """WORKLOAD.md's request i, its sentences cycled for as long as `length` tokens need."""
    text = f"Request {i}: " + " ".join(SENTENCES[(i + k) % len(SENTENCES)] for k in range(length // 6))
    ids = encode(text)
    if len(ids) < length:
        raise ValueError(f"request {i}: {len(ids)} tokens, fewer than {length}")
    return ids[:length]


def start(side: str, gguf: Path, llama_server: Path) -> subprocess.Popen:
    if side == "llama.cpp":
        command = [str(llama_server), "-m", str(gguf), "-t", str(THREADS), "-tb", str(THREADS), "-np", "4"]
        command += ["-c", str(4 * CONTEXT), "--port", str(PORT), "--no-cache-prompt", "-b", "2048", "-ub", "512"]
    else:
        command = [sys.executable, "-m", "heteroserve.entrypoints.openai.api_server", "--port", str(PORT)]
        command += ["--max-model-len", str(CONTEXT), "--kv-cache-dtype", "float16", "--no-enable-prefix-caching"]
        command += ["--kv-cache-memory-bytes", str(4 * CONTEXT * kv_bytes_per_token(gguf))]
        command += ["--uvicorn-log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"{side} server exited with {process.returncode}")
        time.sleep(0.5)
    process.kill()
    raise TimeoutError(f"{side} server not ready")


async def stream(client: httpx.AsyncClient, model: str, prompt: list[int]) -> dict:
    """One request's arrival times of its tokens (a chunk a token: no speculation on either side)."""
    body = {"model": model, "prompt": prompt, "max_tokens": OUTPUT, "temperature": 0, "ignore_eos": True}
    sent = time.perf_counter()
    times = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("text") or (choices[0].get("finish_reason") is None and "text" in choices[0]):
                    times.append(time.perf_counter())
    return {"ttft_s": times[0] - sent, "times": times}


async def phase(prompts: list[list[int]]) -> dict:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", timeout=1800) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        results = await asyncio.gather(*(stream(client, model, p) for p in prompts))
    # Decode at depth: the stretch in which every request of the phase is past its prompt and none has finished.
    start, end = max(r["times"][0] for r in results), min(r["times"][-1] for r in results)
    together = sum(1 for r in results for t in r["times"] if start < t <= end) / (end - start) if end > start else None
    return {
        "ttft_s": [r["ttft_s"] for r in results],
        "tokens": [len(r["times"]) for r in results],
        "decode_tokens_per_s_together": together,
        "decoding_together_s": end - start,
    }


def kv_bytes_per_token(gguf_file: Path) -> int:
    """K and V of one token in every layer, in 16 bits, from the GGUF's metadata."""
    reader = GGUFReader(gguf_file)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def value(key: str) -> int:
        return int(reader.fields[f"{arch}.{key}"].parts[-1][0])

    head_dim = value("embedding_length") // value("attention.head_count")
    return value("block_count") * 2 * value("attention.head_count_kv") * head_dim * 2


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def one_side(side: str, gguf: Path, llama_server: Path, prompts: dict[str, list[list[int]]]) -> dict:
    process = start(side, gguf, llama_server)
    try:
        asyncio.run(phase([prompts["warm_up"][0]]))
        result = {name: asyncio.run(phase(batch)) for name, batch in prompts.items() if name != "warm_up"}
        result["peak_rss_mib"] = peak_rss_mib(process.pid)
        return result
    finally:
        process.terminate()
        process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--read-rate-gbs", type=float, default=None, help="the machine's streaming read rate")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    source = resolve_model(None)
    encode = load_tokenizer(source).encode
    prompts = {name: [long_prompt(encode, i, n) for i, n in enumerate(lengths)] for name, lengths in PHASES.items()}
    prompts["warm_up"] = [long_prompt(encode, 99, 64)]
    rounds = []
    for index in range(args.rounds):
        order = ["heteroserve", "llama.cpp"] if index % 2 == 0 else ["llama.cpp", "heteroserve"]
        result = {side: one_side(side, source.gguf_file, args.llama_server, prompts) for side in order}
        rounds.append(result)
        for side in order:
            r = result[side]
            four, one = r["four_of_6000"], r["one_of_7900"]
            print(
                f"round {index + 1} {side}: 4x6000 TTFT {min(four['ttft_s']):.1f}-{max(four['ttft_s']):.1f} s, "
                f"decode at depth {four['decode_tokens_per_s_together']:.1f} tok/s together; 1x7900 TTFT "
                f"{one['ttft_s'][0]:.1f} s, decode {one['decode_tokens_per_s_together']:.1f} tok/s; peak RSS "
                f"{r['peak_rss_mib']:.0f} MiB",
                flush=True,
            )
    if args.read_rate_gbs:
        # A phase-1 decode step reads the four requests' K and V at their mean depth, and the weights once.
        kv_bytes = sum(n + OUTPUT / 2 for n in PHASES["four_of_6000"]) * kv_bytes_per_token(source.gguf_file)
        step_bytes = kv_bytes + source.gguf_file.stat().st_size
        for side in ("heteroserve", "llama.cpp"):
            rates = [r[side]["four_of_6000"]["decode_tokens_per_s_together"] for r in rounds]
            step_s = len(PHASES["four_of_6000"]) / statistics.median(rates)
            fraction = step_bytes / step_s / (args.read_rate_gbs * 1e9)
            print(
                f"{side}: a decode step at depth reads {step_bytes / 1e6:.0f} MB in {step_s * 1e3:.1f} ms: "
                f"{fraction:.0%} of {args.read_rate_gbs} GB/s"
            )
    summary = {"rounds": rounds, "output_tokens": OUTPUT, "phases": PHASES, "read_rate_gbs": args.read_rate_gbs}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
