"""Batch-1 decode of a mixture of experts against llama.cpp's llama-bench on the same GGUF file, alternating rounds.

The model has Qwen3-30B-A3B's shape scaled to this machine (hidden 1024, 24 layers, 64 experts of 384 with 8
chosen a token, GQA 16 / 4, head 64, the default model's 49152-token vocabulary) with random weights at a trained
model's scale (N(0, 0.02) matrices, unit norms). It is written once by llama.cpp's own tools (convert_hf_to_gguf.py,
then llama-quantize to Q4_K_M) into ~/.cache/heteroserve/bench/, so both engines read the same file.

Each round runs `heteroserve bench latency` (16 prompt tokens, 128 generated) and `llama-bench -p 0 -n 128`
(tg128) on 2 threads, one after the other, alternating which goes first; the ratio is the median of the rounds'
ratios. The active bytes a token (attention, the 8 chosen experts of each layer, the head) over the time a token,
against a 2-thread torch.sum's read rate in this process, says how close to the memory bound each engine runs.

    LLAMA_CPP=/path/to/llama.cpp LLAMA_CPP_BUILD=/path/to/build python bench/moe_decode.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CACHE = Path.home() / ".cache" / "heteroserve" / "bench" / "qwen3moe-a3b-scaled"
SHAPE = {
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 384,
    "intermediate_size": 3072,
    "max_position_embeddings": 4096,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
}
THREADS = 2
OUTPUT_TOKENS = 128


def tokenizer_folder() -> Path:
    """The default model's tokenizer as transformers saved it (heteroserve caches it on first load)."""
    from heteroserve.entrypoints.llm import LLM

    llm = LLM(max_model_len=256)
    folder = Path(tempfile.mkdtemp())
    llm.get_tokenizer().save_pretrained(folder)
    return folder


def make_model(llama_cpp: Path, build: Path) -> Path:
    """The Q4_K_M file, written once."""
    gguf = CACHE / "model-Q4_K_M.gguf"
    if gguf.is_file():
        return gguf
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    hf = CACHE / "hf"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder())
    config = AutoConfig.for_model("qwen3_moe", vocab_size=len(tokenizer), dtype="bfloat16", **SHAPE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(1.0) if param.ndim == 1 else param.normal_(0.0, 0.02)
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    f16 = CACHE / "model-f16.gguf"
    convert = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f16"]
    subprocess.run([*convert, "--outfile", str(f16)], check=True)
    subprocess.run([str(build / "bin" / "llama-quantize"), str(f16), str(gguf), "Q4_K_M"], check=True)
    f16.unlink()
    return gguf


def ours(gguf: Path) -> float:
    """Decode tokens a second of one request (heteroserve bench latency's own figure)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [
                *("heteroserve", "bench", "latency", str(gguf), "--dataset", "random", "--input-len", "16"),
                *("--output-len", str(OUTPUT_TOKENS), "--repeats", "2", "--output-json", out.name),
            ],
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": str(THREADS)},
        )
        return json.loads(Path(out.name).read_text())["heteroserve"]["decode_tokens_per_s"]


def llama_bench(build: Path, gguf: Path) -> float:
    result = subprocess.run(
        [str(build / "bin" / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(OUTPUT_TOKENS)]
        + ["-t", str(THREADS), "-r", "2", "-o", "json"],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(json.loads(result.stdout)[0]["avg_ts"])


def active_bytes(gguf: Path) -> int:
    """Bytes a decode step reads: every tensor but the embedding table, the experts' stacks at 8 / 64."""
    from gguf import GGUFReader

    share = SHAPE["num_experts_per_tok"] / SHAPE["num_experts"]
    total = 0
    for tensor in GGUFReader(gguf).tensors:
        if tensor.name == "token_embd.weight":
            continue
        total += int(tensor.n_bytes * (share if "_exps." in tensor.name else 1))
    return total


def read_rate() -> float:
    """GB/s of a 2-thread torch.sum over 512 MiB (the median of 5)."""
    torch.set_num_threads(THREADS)
    data = torch.ones(128 * 2**20)
    data.sum()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    llama_cpp, build = Path(os.environ["LLAMA_CPP"]), Path(os.environ["LLAMA_CPP_BUILD"])
    gguf = make_model(llama_cpp, build)
    rounds = []
    for r in range(args.rounds):
        if r % 2 == 0:
            mine, theirs = ours(gguf), llama_bench(build, gguf)
        else:
            theirs = llama_bench(build, gguf)
            mine = ours(gguf)
        rounds.append({"heteroserve": mine, "llama_cpp": theirs, "ratio": mine / theirs})
        print(f"round {r}: heteroserve {mine:.1f} tok/s, llama.cpp {theirs:.1f} tok/s, ratio {mine / theirs:.2f}")
    rate, nbytes = read_rate(), active_bytes(gguf)
    median = {k: statistics.median(x[k] for x in rounds) for k in ("heteroserve", "llama_cpp", "ratio")}
    summary = {
        "model": str(gguf),
        "rounds": rounds,
        "median": median,
        "active_bytes_per_token": nbytes,
        "torch_sum_gb_s": rate,
        "fraction_of_read_rate": {k: nbytes * median[k] / 1e9 / rate for k in ("heteroserve", "llama_cpp")},
    }
    print(json.dumps(summary, indent=2))
    if args.output_json:
        args.output_json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
