"""Resident memory of a served 4-bit GGUF mixture of experts against its file size plus its KV cache.

Loads the file (by default bench/moe_decode.py's Q4_K_M model with Qwen3-30B-A3B's shape scaled to this machine,
written there by llama.cpp's own tools), answers one request, and reports the process's resident memory
(anonymous and file-backed), its peak during the load, the imports' share, and the model's tensors by kind.

    python bench/moe_memory.py [--model FILE.gguf] [--output-json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

CACHE = Path.home() / ".cache" / "heteroserve" / "bench" / "qwen3moe-a3b-scaled" / "model-Q4_K_M.gguf"
KV_CACHE_BYTES = 64 << 20


def status(key: str) -> int:
    """A /proc/self/status figure in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def tensor_bytes(model) -> dict[str, int]:
    """Bytes of the model's tensors by the class and attribute holding them (each storage counted once)."""
    import torch

    sizes: collections.Counter[str] = collections.Counter()
    seen: set[int] = set()
    stack = [("model", model)]
    while stack:
        name, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            sizes[f"{name} {str(obj.dtype).removeprefix('torch.')}"] += obj.untyped_storage().nbytes()
        elif isinstance(obj, (list, tuple)):
            stack.extend((name, v) for v in obj)
        elif isinstance(obj, dict):
            stack.extend((name, v) for v in obj.values())
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            owner = "module" if isinstance(obj, torch.nn.Module) else type(obj).__name__
            stack.extend((f"{owner}.{k}", v) for k, v in vars(obj).items())
    return dict(sizes.most_common())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=CACHE)
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()

    from heteroserve.entrypoints.llm import LLM
    from heteroserve.sampling_params import SamplingParams

    imports = status("VmRSS")
    llm = LLM(model=str(args.model), max_model_len=512, kv_cache_memory_bytes=KV_CACHE_BYTES)
    prompt = {"prompt_token_ids": list(range(100, 132))}
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    file_bytes = args.model.stat().st_size
    result = {
        "model": str(args.model),
        "file_bytes": file_bytes,
        "kv_cache_bytes": KV_CACHE_BYTES,
        "rss_after_imports": imports,
        "rss_serving": status("VmRSS"),
        "rss_anon": status("RssAnon"),
        "rss_file": status("RssFile"),
        "rss_peak": status("VmHWM"),
        "tensor_bytes": tensor_bytes(llm.engine.runner.model),
    }
    budget = file_bytes + KV_CACHE_BYTES
    result["rss_over_file_plus_kv"] = result["rss_serving"] / budget
    result["rss_less_imports_over_file_plus_kv"] = (result["rss_serving"] - imports) / budget
    result["peak_over_file_plus_kv"] = result["rss_peak"] / budget
    print(json.dumps(result, indent=1))
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
