"""The operators the model calls, in plain torch: every platform's baseline and the CPU fallback.

These are the numerics the tests check against transformers; a device kernel must agree with them.
Shapes use the flattened batch: T tokens, Hq query heads, Hkv key/value heads, head size D.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from heteroserve.platforms.attention import ScoreModifiers
from heteroserve.platforms.lora_rows import LoRARows


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalised in float32 like the reference implementations, scaled in the input dtype."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D]; cos, sin: [max_positions, D] tables; rotate-half (Hugging Face) layout."""
    cos = cos[positions].to(q.dtype).unsqueeze(1)
    sin = sin[positions].to(q.dtype).unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dimension (the fused projection); returns silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up]; returns gelu(gate) * up with the tanh approximation (GeGLU, as Gemma computes it)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Greedy tokens: each row's first maximum (max's indices are argmax's, and on the CPU cheaper than
    argmax: docs/PLATFORMS.md, "CPU kernels")."""
    return x.max(dim=-1).indices


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Stores token i's k, v at cache slot slot_mapping[i]; caches are [blocks, block_size, Hkv, D], in the
    activations' dtype or a narrower one (`kv_cache_dtype`)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    modifiers: ScoreModifiers | None = None,
) -> torch.Tensor:
    """One query per request: q [B, Hq, D] over its blocks (block_tables [B, max_blocks]); mask True = attend.
    modifiers: soft-capping and sinks (attention.ScoreModifiers)."""
    b, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    shape = (b, -1, num_kv_heads, head_dim)
    keys = k_cache.index_select(0, block_tables.flatten()).view(shape).transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
    values = v_cache.index_select(0, block_tables.flatten()).view(shape).transpose(1, 2).to(q.dtype)
    if modifiers is not None:
        return modified_attention(q[:, :, None], keys, values, mask, scale, modifiers)[:, :, 0]
    q = q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)  # query head h uses kv head h // group
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(b, num_heads, head_dim)


def bidirectional_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One encoder sequence: q, keys, values [n, H, D], every token attending to every token."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), scale=scale)
    return out.transpose(0, 1)


def prefill_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    modifiers: ScoreModifiers | None = None,
) -> torch.Tensor:
    """One chunk: q [n, Hq, D] over keys/values [context, Hkv, D]; mask None means causal over the chunk (whose
    queries are the last n keys)."""
    q, keys, values = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    if modifiers is not None:
        n, context = q.shape[2], keys.shape[2]
        if mask is None:
            mask = torch.ones(n, context, dtype=torch.bool, device=q.device).tril(context - n)
        return modified_attention(q, keys, values, mask, scale, modifiers)[0].transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def modified_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    modifiers: ScoreModifiers,
) -> torch.Tensor:
    """q [B, Hq, S, D] over keys/values [B, Hkv, L, D], mask broadcast to [B, Hq, S, L] (True = attend), with the
    scores capped at +-softcap by tanh and/or each head's sink logit joining the softmax (its probability is then
    dropped); the softmax in float32 (transformers' eager attention, which Gemma 2 and gpt-oss use)."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    if modifiers.softcap is not None:
        scores = modifiers.softcap * torch.tanh(scores / modifiers.softcap)
    scores = scores.masked_fill(~mask, float("-inf")).float()
    if modifiers.sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)
    sinks = modifiers.sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)


def lora_add(y: torch.Tensor, x: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor, rows: LoRARows) -> torch.Tensor:
    """y [T, N] plus the adapters' products x A^T B^T on their rows, in place; a_t [slots, K, R] and b_t [slots, R,
    N] every slot's matrices (in x's dtype or one --lora-dtype gives them, brought to x's for the product), rows:
    which rows run under which slot. Rows of the base model are not touched."""
    if rows.slot_range is not None:
        a_t, b_t = a_t[rows.slot_range[0] : rows.slot_range[1]], b_t[rows.slot_range[0] : rows.slot_range[1]]
    else:
        a_t, b_t = a_t.index_select(0, rows.slot_index), b_t.index_select(0, rows.slot_index)
    a_t, b_t = a_t.to(x.dtype), b_t.to(x.dtype)
    if rows.span is not None:
        start, end = rows.span
        grouped = x[start:end].view(a_t.shape[0], -1, x.shape[1])
        y[start:end] += torch.bmm(torch.bmm(grouped, a_t), b_t).flatten(0, 1)
        return y
    low = torch.bmm(x[rows.gather], a_t) * rows.mask
    return y.index_add_(0, rows.gather.flatten(), torch.bmm(low, b_t).flatten(0, 1))
