"""A family's checkpoint tensors under Llama's names and in our layout, as they stream in.

Per `ModelArch.checkpoint`: layer tensors are renamed (Gemma 2's `pre_feedforward_layernorm` is our pre-MLP
`post_attention_layernorm`, ...), fused q/k/v and gate/up projections are split into their parts (so sharding and
quantised formats see one name per projection), 1 is added to the norm weights of families that scale by 1 + w,
and q/k rows (with their biases and norm weights) are reordered by `ModelArch.qk_row_order`, where the family's
rotary is partial or interleaved. Compressed projections reorder and split their rows in their packed form.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from heteroserve.model.arch import ModelArch

_LAYER = re.compile(r"^(model\.layers\.(\d+)\.)(.+)$")
_EXPERT = re.compile(r"^(mlp\.experts\.\d+\.)([^.]+)(\..+)$")
_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def canonical_tensors(tensors: Iterable[tuple[str, object]], arch: ModelArch) -> Iterator[tuple[str, object]]:
    layout = arch.checkpoint
    latent = any(layer.mla is not None for layer in arch.layers)
    order = None if latent else arch.qk_row_order()  # latent attention orders its rotary rows at load (weights.py)
    for name, tensor in tensors:
        match = _LAYER.match(name)
        if match is None:
            yield name, _offset_norm(name, tensor) if layout.norm_offset else tensor
            continue
        prefix, index, rest = match.groups()
        if int(index) >= arch.num_layers + layout.extra_layers:
            raise ValueError(f"checkpoint tensor {name!r} is past the model's {arch.num_layers} layers")
        if int(index) >= arch.num_layers:  # a multi-token-prediction layer: its drafts are not used here
            continue
        for old, new in layout.renames:
            if rest.startswith(old + "."):
                rest = new + rest[len(old) :]
                break
        expert = _EXPERT.match(rest) if layout.expert_projections else None
        if expert is not None and expert.group(2) in layout.expert_projections:
            ours = _EXPERT_NAMES[layout.expert_projections.index(expert.group(2))]
            rest = expert.group(1) + ours + expert.group(3)
        parts = _split_stacked_experts(rest, tensor) if layout.stacked_experts else None
        for part, value in parts or _split_fused(rest, tensor, arch):
            if layout.norm_offset:
                value = _offset_norm(part, value)
            if order is not None:
                value = _reorder_qk(part, value, order, arch)
            yield prefix + part, value


def _split_fused(rest: str, tensor, arch: ModelArch) -> list[tuple[str, object]]:
    layout = arch.checkpoint
    d = arch.head_dim
    if layout.fused_qkv and rest.startswith(layout.fused_qkv + "."):
        suffix = rest[len(layout.fused_qkv) :]
        sizes = [arch.num_heads * d, arch.num_kv_heads * d, arch.num_kv_heads * d]
        return list(zip([f"self_attn.{p}_proj{suffix}" for p in "qkv"], split_rows(tensor, sizes), strict=True))
    if layout.fused_gate_up and rest.startswith(layout.fused_gate_up + "."):
        suffix = rest[len(layout.fused_gate_up) :]
        sizes = [arch.intermediate_size] * 2
        return list(zip([f"mlp.gate_proj{suffix}", f"mlp.up_proj{suffix}"], split_rows(tensor, sizes), strict=True))
    return [(rest, tensor)]


def _split_stacked_experts(rest: str, tensor) -> list[tuple[str, object]] | None:
    """A layer's expert stack (CheckpointLayout.stacked_experts) as each expert's projections under our names, in
    our [out, in] layout with gate and up apart; None for any other tensor."""
    if not rest.startswith("mlp.experts.") or rest.count(".") != 2:
        return None
    stack = rest.removeprefix("mlp.experts.")
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"mlp.experts.{stack}: a compressed expert stack of this layout is not supported")
    parts = []
    for e, expert in enumerate(tensor):
        name = f"mlp.experts.{e}."
        if stack == "gate_up_proj":  # [hidden, 2I], columns gate, up, gate, up, ...
            parts += [(name + "gate_proj.weight", expert[:, 0::2].T), (name + "up_proj.weight", expert[:, 1::2].T)]
        elif stack == "gate_up_proj_bias":
            parts += [(name + "gate_proj.bias", expert[0::2]), (name + "up_proj.bias", expert[1::2])]
        elif stack == "down_proj":  # [I, hidden]
            parts.append((name + "down_proj.weight", expert.T))
        elif stack == "down_proj_bias":
            parts.append((name + "down_proj.bias", expert))
        else:
            raise ValueError(f"unexpected expert stack mlp.experts.{stack}")
    return [(part, value.contiguous()) for part, value in parts]


def split_rows(tensor, sizes: list[int]) -> list[object]:
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"a fused projection has {tensor.shape[0]} rows, expected {sum(sizes)} ({sizes})")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    if isinstance(tensor, torch.Tensor):
        return [tensor[s : s + n].clone() for s, n in zip(starts, sizes, strict=True)]
    return [tensor.slice_rows(s, s + n) for s, n in zip(starts, sizes, strict=True)]


def _offset_norm(name: str, tensor):
    """1 + w in float32, as the reference computes it (a bfloat16 sum would round it to 2^-7 near 1)."""
    return tensor.float() + 1.0 if name.endswith("norm.weight") and isinstance(tensor, torch.Tensor) else tensor


def _reorder_qk(name: str, tensor, order: torch.Tensor, arch: ModelArch):
    """Rows of q/k projections and biases, and q/k norm weights, reordered within each head."""
    if not name.startswith(("self_attn.q_", "self_attn.k_")):
        return tensor
    if name.endswith("norm.weight") and tensor.shape[0] == arch.head_dim:  # per-head norm: one head's order
        return tensor[order]
    heads = tensor.shape[0] // arch.head_dim
    rows = (torch.arange(heads)[:, None] * arch.head_dim + order[None, :]).flatten()
    if isinstance(tensor, torch.Tensor):
        return tensor[rows].contiguous()
    if not hasattr(tensor, "permute_rows"):
        raise ValueError(f"{name}: {type(tensor).__name__} weights cannot reorder their rows for this family's rotary")
    return tensor.permute_rows(rows)
