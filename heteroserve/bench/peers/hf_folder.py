"""A Hugging Face checkpoint folder (config.json, tokenizer, safetensors) for a peer that loads nothing else (vLLM):
a GGUF model dequantised to float32 by transformers, once (cached beside the tokenizers); a folder as it is."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from heteroserve.model.loader import load_tokenizer
from heteroserve.model.loader.source import ModelSource

CACHE = Path.home() / ".cache" / "heteroserve" / "dequantised"


def file_key(path: Path) -> str:
    """A short key for a cached copy of `path`: another file, size or modification time makes another key."""
    stat = path.stat()
    return hashlib.sha1(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def hf_checkpoint_folder(source: ModelSource, cache: Path = CACHE) -> Path:
    """The folder a peer loads `source` from: WORKLOAD.md's float form of a GGUF file (its tensors dequantised to
    float32, saved as safetensors with its config and tokenizer), or the checkpoint folder itself."""
    if source.gguf_file is None:
        return source.folder
    folder = cache / f"{source.gguf_file.stem}-{file_key(source.gguf_file)}"
    if folder.is_dir():
        return folder
    import torch
    from transformers import AutoModelForCausalLM

    print(f"dequantising {source.gguf_file.name} to float32 safetensors in {folder}")
    model = AutoModelForCausalLM.from_pretrained(source.folder, gguf_file=source.gguf_file.name, dtype=torch.float32)
    model.hf_quantizer = None  # the GGUF loader's: the tensors saved are plain float32, and config.json says so
    del model.config.quantization_config
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=".staging-"))
    try:
        model.save_pretrained(staging)
        load_tokenizer(source).save_pretrained(staging)
        staging.rename(folder)  # whole or absent: a run stopped half-way leaves no folder that looks complete
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
