"""A float copy of a GGUF file for llama.cpp: every quantised tensor dequantised (by gguf-py) and stored as float32
or bfloat16, so that the llama-cpp peer runs the weights our engine runs under `--quantization none`.

Written once and cached beside the dequantised checkpoint folders (hf_folder.py); the metadata is copied as it is
but for the file type, which says what the tensors now are.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from heteroserve.bench.peers.hf_folder import CACHE, file_key

# llama.cpp's llama_ftype values for the file types written here (general.file_type).
_FILE_TYPES = {torch.float32: ("f32", 0), torch.bfloat16: ("bf16", 32)}


def float_gguf(gguf_file: Path, dtype: torch.dtype, cache: Path = CACHE) -> Path:
    """`gguf_file` with its tensors in `dtype` (float32 or bfloat16; vectors such as norms stay float32, as
    llama.cpp's own conversion keeps them)."""
    import gguf

    if dtype not in _FILE_TYPES:
        raise SystemExit(f"--peer llama-cpp: no float copy of a GGUF file in {dtype} (float32 or bfloat16)")
    name, file_type = _FILE_TYPES[dtype]
    target = cache / f"{gguf_file.stem}-{file_key(gguf_file)}-{name}.gguf"
    if target.is_file():
        return target
    print(f"dequantising {gguf_file.name} to a {name} GGUF file in {target}")
    reader = gguf.GGUFReader(gguf_file)
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkstemp(dir=cache, prefix=".staging-", suffix=".gguf")[1])
    try:
        architecture = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
        writer = gguf.GGUFWriter(staging, architecture)
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue  # the writer writes these itself
            value = file_type if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
        for tensor in reader.tensors:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            if dtype == torch.bfloat16 and values.ndim > 1:
                stored = gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16)
                writer.add_tensor(tensor.name, stored, raw_dtype=gguf.GGMLQuantizationType.BF16)
            else:
                writer.add_tensor(tensor.name, values)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        staging.rename(target)  # whole or absent
    finally:
        staging.unlink(missing_ok=True)
    return target
