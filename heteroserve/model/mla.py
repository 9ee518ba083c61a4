"""Multi-head latent attention (DeepSeek-V2/V3; arch.MLASpec), computed in its absorbed form.

A token's keys and values for every head are linear in one latent vector c (kv_lora_rank wide, RMS-normalised):
k_nope[h] = W_UK[h] c and v[h] = W_UV[h] c, with a rotary key k_rope shared by the heads. So the KV cache holds
[c, k_rope] once a token (one "KV head" of kv_lora_rank + qk_rope_head_dim), and attention runs as multi-query
attention in the latent space: each query head is absorbed into it (q_lat[h] = W_UK[h]^T q_nope[h], next to its
rotary part), since q_nope[h] . k_nope[h] = q_lat[h] . c. The values are the cached vectors themselves (the
platform's attention reads the V cache as the K cache: ModelArch.values_in_keys); of each head's output the latent
part is projected by W_UV[h] to the head's value, and the rotary part, which no value has, is dropped.
"""

from __future__ import annotations

import torch
from torch import nn

from heteroserve.distributed.parallel_state import ParallelGroups
from heteroserve.model.arch import LayerSpec, ModelArch
from heteroserve.model.layers.norm import RMSNorm
from heteroserve.model.layers.parameters import empty_weight
from heteroserve.platforms.attention import AttentionBackend
from heteroserve.platforms.operators import OperatorTable


class LatentAttention(nn.Module):
    """The attention block of a layer whose spec has `mla`. kv_b_proj [heads * (nope + v), kv_lora_rank] is kept
    dense in float32 and split per head into W_UK and W_UV at load (`absorb`)."""

    # The fused decode layer and the LoRA products read these of a standard attention block; this one has none.
    qkv_proj = qkv_bias = q_norm = k_norm = None

    def __init__(
        self,
        arch: ModelArch,
        spec: LayerSpec,
        ops: OperatorTable,
        parallel: ParallelGroups,
        backend: AttentionBackend,
        index: int,
        scale: float,
    ) -> None:
        super().__init__()
        mla = spec.mla
        self.index = index
        self.spec, self.mla = spec, mla
        self.linear = ops.linear
        self.backend = backend
        self.parallel = parallel
        self.num_heads = arch.num_heads
        self.scale = scale
        h, heads = arch.hidden_size, arch.num_heads
        qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = empty_weight(heads * qk_dim, h)
        else:
            self.q_a_proj = empty_weight(mla.q_lora_rank, h)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, arch.rms_norm_eps, ops)
            self.q_b_proj = empty_weight(heads * qk_dim, mla.q_lora_rank)
        self.kv_a_proj = empty_weight(mla.kv_lora_rank + mla.qk_rope_head_dim, h)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, arch.rms_norm_eps, ops)
        self.kv_b_proj = empty_weight(heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
        self.o_proj = empty_weight(h, heads * mla.v_head_dim)
        self.w_uk: nn.Parameter | None = None  # [heads, nope, kv_lora_rank]
        self.w_uv: nn.Parameter | None = None  # [heads, v, kv_lora_rank]

    def projections(self) -> list[str]:
        """The names of this block's weights that go through the platform's linear op."""
        q = ["q_proj"] if self.mla.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
        return [*q, "kv_a_proj", "o_proj"]

    def absorb(self) -> None:
        """W_UK and W_UV per head from kv_b_proj (dense float32: the absorbed products are batched per head)."""
        mla = self.mla
        kv_b = self.kv_b_proj.data.float().view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, -1)
        self.w_uk = nn.Parameter(kv_b[:, : mla.qk_nope_head_dim].contiguous(), requires_grad=False)
        self.w_uv = nn.Parameter(kv_b[:, mla.qk_nope_head_dim :].contiguous(), requires_grad=False)
        del self.kv_b_proj

    def forward(self, x, positions, rotary, kv_cache, meta, lora) -> torch.Tensor:
        mla = self.mla
        if self.mla.q_lora_rank is None:
            q = self.linear(x, self.q_proj)
        else:
            q = self.linear(self.q_a_layernorm(self.linear(x, self.q_a_proj)), self.q_b_proj)
        q = q.view(len(x), self.num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.linear(x, self.kv_a_proj).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_rope, k_rope = rotary(positions, q_rope.contiguous(), k_rope.contiguous().view(len(x), 1, -1))
        q_latent = torch.einsum("thn,hnr->thr", q_nope.float(), self.w_uk).to(x.dtype)
        query = torch.cat([q_latent, q_rope], dim=-1)
        key = torch.cat([latent[:, None, :], k_rope], dim=-1)
        out = self.backend.forward(query, key, key, kv_cache[0], kv_cache[1], meta, self.scale)
        values = torch.einsum("thr,hvr->thv", out[..., : mla.kv_lora_rank].float(), self.w_uv).to(x.dtype)
        return self.parallel.all_reduce(self.linear(values.flatten(1), self.o_proj))
