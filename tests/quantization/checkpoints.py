"""Writes GPTQ and AWQ checkpoints the way AutoGPTQ / GPTQModel and AutoAWQ do, from tiny float models.

The quantiser is round-to-nearest (GPTQ's error feedback changes which integers are chosen, not how they are
stored). The packing follows the reference tools loop for loop, written here independently of the loader:
- GPTQ (AutoGPTQ `qlinear_cuda_old.QuantLinear.pack`): qweight [K / p, N] with input row r * p + j in bits
  [bits j, bits (j + 1)) of word r; qzeros [G, N / p] packed the same way along N, storing zero - 1
  (format "gptq"; "gptq_v2" stores the zero); scales fp16 [G, N]; g_idx int32 [K]. With act-order, columns
  are quantised in order of decreasing activation size and g_idx[k] = position of k in that order // group.
- AWQ (AutoAWQ `WQLinear_GEMM.from_linear`): qweight [K, N / 8] with output column 8 c + ORDER[i] in bits
  [4 i, 4 i + 4) of word c, ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; qzeros [G, N / 8] the same; scales fp16 [G, N].
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.model.tiny_models import build_hf_model, load_reference

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Wide enough that group sizes 32, 64 and 128 all divide every projection's input.
QUANT_TINY = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "tie_word_embeddings": False,
}
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _to_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def pack_along_rows(values: np.ndarray, bits: int) -> torch.Tensor:
    """[R, C] small integers -> int32 [R / p, C], as AutoGPTQ packs qweight."""
    per_word = 32 // bits
    words = np.zeros((values.shape[0] // per_word, values.shape[1]), dtype=np.uint64)
    for j in range(per_word):
        words |= values[j::per_word].astype(np.uint64) << np.uint64(bits * j)
    return _to_int32(words)


def pack_along_columns(values: np.ndarray, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """[R, C] small integers -> int32 [R, C / p], slot j of word c holding column p c + order[j]."""
    per_word = 32 // bits
    order = order or list(range(per_word))
    words = np.zeros((values.shape[0], values.shape[1] // per_word), dtype=np.uint64)
    for j in range(per_word):
        words |= values[:, order[j] :: per_word].astype(np.uint64) << np.uint64(bits * j)
    return _to_int32(words)


def _rtn(w: torch.Tensor, maxq: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's Quantizer.find_params for the columns of one group: (q [N, g], scale fp16 [N], zero [N])."""
    low, high = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
    if sym:
        amax = torch.maximum(low.abs(), high)
        scale, zero = 2 * amax / maxq, torch.full_like(amax, (maxq + 1) // 2)
    else:
        scale = (high - low) / maxq
        zero = (-low / scale).round().clamp(1, maxq)  # >= 1: a stored zero - 1 of -1 would corrupt AutoGPTQ's words
    scale = scale.half().float()
    q = (w / scale[:, None]).round() + zero[:, None]
    return q.clamp(0, maxq), scale, zero


def gptq_quantize(w: torch.Tensor, bits: int, group_size: int, desc_act: bool, sym: bool, v2: bool = False, seed=0):
    """(the linear's checkpoint tensors, the float weight they decode to)."""
    n, k = w.shape
    group = k if group_size == -1 else group_size
    maxq = 2**bits - 1
    # GPTQ's act-order sorts columns by the Hessian diagonal; any fixed permutation exercises the layout.
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).int()
    q, scales, zeros = torch.empty(n, k), torch.empty(k // group, n), torch.empty(k // group, n)
    for g in range(k // group):
        cols = order[g * group : (g + 1) * group]
        q[:, cols], scales[g], zeros[g] = _rtn(w[:, cols], maxq, sym)
    dequantised = (q - zeros[g_idx.long()].t()) * scales[g_idx.long()].t()
    stored_zeros = zeros if v2 else zeros - 1
    parts = {
        "qweight": pack_along_rows(q.t().numpy().astype(np.int64), bits),
        "qzeros": pack_along_columns(stored_zeros.numpy().astype(np.int64), bits),
        "scales": scales.half(),
        "g_idx": g_idx,
    }
    return parts, dequantised


def awq_quantize(w: torch.Tensor, group_size: int):
    n, k = w.shape
    q, scales, zeros = torch.empty(n, k), torch.empty(k // group_size, n), torch.empty(k // group_size, n)
    for g in range(k // group_size):
        cols = slice(g * group_size, (g + 1) * group_size)
        q[:, cols], scales[g], zeros[g] = _rtn(w[:, cols], 15, sym=False)
    dequantised = (q - zeros.repeat_interleave(group_size, 0).t()) * scales.repeat_interleave(group_size, 0).t()
    parts = {
        "qweight": pack_along_columns(q.t().numpy().astype(np.int64), 4, AWQ_PACK_ORDER),
        "qzeros": pack_along_columns(zeros.numpy().astype(np.int64), 4, AWQ_PACK_ORDER),
        "scales": scales.half(),
    }
    return parts, dequantised


def write_quantized(
    model_type: str,
    folder: Path,
    method: str,
    settings: dict,
    config_file: str = "config.json",
    overrides: dict | None = None,
):
    """A tiny random model with every projection quantised and packed (a mixture of experts' per-expert ones too,
    under the names its checkpoints use); returns the transformers model with the decoded weights (the
    reference), read back from a float copy of them beside it (FOLDER-decoded)."""
    model = build_hf_model(model_type, {**QUANT_TINY, **(overrides or {})}, seed=5)
    model.save_pretrained(folder, safe_serialization=True)
    saved = {}
    for file in sorted(folder.glob("*.safetensors")):
        saved.update(load_file(str(file)))
        file.unlink()
    tensors, decoded_tensors = {}, {}
    for name, param in saved.items():
        prefix = name.removesuffix(".weight")
        if not prefix.endswith(PROJECTIONS):
            tensors[name] = decoded_tensors[name] = param.clone()
            continue
        if method == "gptq":
            seed = 0 if prefix.endswith(("q_proj", "k_proj", "v_proj")) else 1  # shared input, shared order
            parts, decoded = gptq_quantize(
                param,
                settings["bits"],
                settings["group_size"],
                settings["desc_act"],
                settings["sym"],
                settings.get("checkpoint_format") == "gptq_v2",
                seed,
            )
        else:
            parts, decoded = awq_quantize(param, settings["group_size"])
        tensors.update({f"{prefix}.{suffix}": t for suffix, t in parts.items()})
        decoded_tensors[name] = decoded.to(param.dtype)
    save_file(tensors, str(folder / "model.safetensors"))
    reference = folder.with_name(folder.name + "-decoded")
    reference.mkdir()
    save_file(decoded_tensors, str(reference / "model.safetensors"))
    (reference / "config.json").write_bytes((folder / "config.json").read_bytes())
    if config_file == "config.json":
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = {"quant_method": method, **settings}
        (folder / "config.json").write_text(json.dumps(config))
    else:
        (folder / config_file).write_text(json.dumps(settings))
    return load_reference(reference).model
