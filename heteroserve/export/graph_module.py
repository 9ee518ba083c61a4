"""The decoder restated as one traceable torch module with the KV cache as explicit inputs and outputs.

The engine's `DecoderModel` calls its platform's operators and writes its cache in place; a graph compiler needs
pure functions of tensors instead. This module takes the loaded model's weights (compressed ones dequantised, or
4-bit ones as MatMulNBits) and computes a step in plain torch: norms, rotary and the MLP's activation are the
reference operators themselves (heteroserve/platforms/reference_ops.py), the cache writes and the attention are
written out here. It returns the logits of every input row and each layer's updated cache.

Inputs ([B] sequences, [S] rows each):
  input_ids, positions [B, S] int64; seq_lens [B] int64 (each sequence's cached tokens after this step);
  per layer its key and value caches; then, in the paged layout, slot_mapping [B, S] int64 (-1: a padding row)
  and block_tables [B, max_blocks] int64 (in the contiguous layout a padding row has position -1).
Outputs: logits [B, S, vocab] float32, then per layer the updated key and value caches.
"""

from __future__ import annotations

import torch
from torch import nn

from heteroserve.export.kv_layout import ContiguousKV, PagedKV
from heteroserve.export.matmul_nbits import NBitsProjection, fits_matmul_nbits
from heteroserve.model.arch import ImplementedTraits, unimplemented_traits
from heteroserve.model.decoder import DecoderModel
from heteroserve.platforms.reference_ops import gelu_tanh_and_mul, rms_norm, rotary, silu_and_mul

# The layer traits (model.arch.LayerSpec) this graph computes; a model with another is refused by GraphDecoder.
IMPLEMENTED_TRAITS: ImplementedTraits = {
    "sliding_window": None,
    "rotary": None,
    "qkv_bias": None,
    "o_bias": None,
    "qk_norm": frozenset({"head", "projection"}),
    "attn_softcap": None,
    "pre_norms": None,
    "output_norms": None,
    "activation": frozenset({"silu", "gelu_tanh"}),
    "mlp_bias": None,
    "residual_scale": None,
}
# The model-level steps (ModelArch.model_traits) it computes.
IMPLEMENTED_MODEL_TRAITS = ("embed_scale", "logits_scale", "final_softcap")


def dense_weight(weight: torch.Tensor | object, dtype: torch.dtype) -> torch.Tensor:
    """A projection or embedding as a dense tensor in `dtype` (a compressed weight is dequantised)."""
    if isinstance(weight, torch.Tensor):
        return weight.detach().to(dtype)
    return weight.dequantize(torch.float32).to(dtype)


class DenseProjection(nn.Module):
    """A projection stored as a dense matrix [N, K] in the export's dtype."""

    def __init__(self, weight: torch.Tensor | object, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", dense_weight(weight, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


def projection(weight: torch.Tensor | object, dtype: torch.dtype, int4: str) -> nn.Module:
    """A projection as the graph stores it: 4-bit weights as MatMulNBits when asked and possible, else dense."""
    if int4 == "matmulnbits" and fits_matmul_nbits(weight):
        return NBitsProjection(weight, dtype)
    return DenseProjection(weight, dtype)


def _buffer(module: nn.Module, name: str, owner: nn.Module | None, attr: str, dtype: torch.dtype) -> None:
    """Registers owner.attr (a norm's weight or a bias; None where the layer has none) as a buffer in `dtype`."""
    value = None if owner is None else getattr(owner, attr)
    module.register_buffer(name, None if value is None else value.detach().to(dtype))


class GraphLayer(nn.Module):
    """One decoder layer's weights as buffers, so the exporter stores them as the graph's initializers; its steps
    are model/arch.py's order of operations with the layer's LayerSpec."""

    def __init__(self, layer, dtype: torch.dtype, int4: str) -> None:
        super().__init__()
        attn = layer.self_attn
        self.spec = layer.spec
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = attn.scale
        self.eps = layer.eps
        self.window, self.rotary = layer.spec.sliding_window, layer.spec.rotary
        _buffer(self, "input_norm", layer.input_layernorm, "weight", dtype)
        _buffer(self, "post_norm", layer.post_attention_layernorm, "weight", dtype)
        _buffer(self, "attn_output_norm", layer.attn_output_norm, "weight", dtype)
        _buffer(self, "mlp_output_norm", layer.mlp_output_norm, "weight", dtype)
        _buffer(self, "q_norm", attn.q_norm, "weight", dtype)
        _buffer(self, "k_norm", attn.k_norm, "weight", dtype)
        _buffer(self, "qkv_bias", attn, "qkv_bias", dtype)
        _buffer(self, "o_bias", attn, "o_bias", dtype)
        _buffer(self, "gate_up_bias", layer, "gate_up_bias", dtype)
        _buffer(self, "down_bias", layer, "down_bias", dtype)
        self.qkv = projection(attn.qkv_proj, dtype, int4)
        self.o_proj = projection(attn.o_proj, dtype, int4)
        self.gate_up = projection(layer.gate_up_proj, dtype, int4)
        self.down = projection(layer.down_proj, dtype, int4)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return x if weight is None else rms_norm(x, weight, self.eps)

    def _add(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x if bias is None else x + bias

    def forward(self, x, rows, cos, sin, mask, k_cache, v_cache, slots, block_tables, layout):
        """rows: every token's position, flattened (padding rows at 0), for the layer's rotary tables cos and sin;
        mask: the one of the layer's window."""
        b, s, _ = x.shape
        spec = self.spec
        qkv = self._add(self.qkv(self._norm(x, self.input_norm)), self.qkv_bias)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if spec.qk_norm == "projection":
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q = q.reshape(b, s, self.num_heads, self.head_dim)
        k = k.reshape(b, s, self.num_kv_heads, self.head_dim)
        v = v.reshape(b, s, self.num_kv_heads, self.head_dim)
        if spec.qk_norm == "head":
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q, k = rotary(rows, q.flatten(0, 1), k.flatten(0, 1), cos, sin)
        q = q.reshape(b, s, self.num_heads, self.head_dim)
        k = k.reshape(b, s, self.num_kv_heads, self.head_dim)
        k_cache = layout.write(k_cache, k, slots)
        v_cache = layout.write(v_cache, v, slots)
        keys = layout.read(k_cache, block_tables).to(x.dtype)  # [B, L, Hkv, D]
        values = layout.read(v_cache, block_tables).to(x.dtype)
        group = self.num_heads // self.num_kv_heads  # query head h reads kv head h // group
        q = q.reshape(b, s, self.num_kv_heads, group, self.head_dim).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, S, D]
        keys, values = keys.permute(0, 2, 1, 3)[:, :, None], values.permute(0, 2, 1, 3)[:, :, None]
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale  # [B, Hkv, G, S, L]
        if spec.attn_softcap is not None:
            scores = spec.attn_softcap * torch.tanh(scores / spec.attn_softcap)
        scores = torch.where(mask, scores, torch.finfo(scores.dtype).min)
        out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, Hkv, G, S, D]
        out = out.permute(0, 3, 1, 2, 4).reshape(b, s, q_size)
        a = self._norm(self._add(self.o_proj(out), self.o_bias), self.attn_output_norm)
        x = x + a * spec.residual_scale if spec.residual_scale != 1.0 else x + a
        gate_up = self._add(self.gate_up(self._norm(x, self.post_norm)), self.gate_up_bias)
        act = silu_and_mul(gate_up) if spec.activation == "silu" else gelu_tanh_and_mul(gate_up)
        m = self._norm(self._add(self.down(act), self.down_bias), self.mlp_output_norm)
        x = x + m * spec.residual_scale if spec.residual_scale != 1.0 else x + m
        return x, k_cache, v_cache


class GraphDecoder(nn.Module):
    """A text decoder (the language model of a vision-language one) with its cache passed in and returned."""

    def __init__(
        self, model: DecoderModel, dtype: torch.dtype, layout: PagedKV | ContiguousKV, int4: str = "dequantize"
    ) -> None:
        super().__init__()
        if model.parallel.world_size > 1:
            raise ValueError("export takes the whole model on one rank, not a tensor / pipeline parallel share")
        arch = model.arch
        missing = sorted({t for spec in arch.layers for t in unimplemented_traits(spec.traits(), IMPLEMENTED_TRAITS)})
        missing += [f"{k}={v}" for k, v in arch.model_traits().items() if k not in IMPLEMENTED_MODEL_TRAITS]
        if missing:
            raise ValueError(f"export does not implement these traits of {arch.model_type}: {', '.join(missing)}")
        self.layout = layout
        self.windows = arch.sliding_windows
        self.embed_scale, self.logits_scale, self.final_softcap = (
            arch.embed_scale,
            arch.logits_scale,
            arch.final_softcap,
        )
        # Stored [hidden, vocab]: the head's product reads it as it is, the lookup takes columns, so a tied
        # embedding is one initializer (the exporter folds any transpose of a weight into a second copy).
        self.register_buffer("embed_t", dense_weight(model.embed_tokens, dtype).t().contiguous())
        self.register_buffer("lm_head", None if model.lm_head is None else dense_weight(model.lm_head, dtype))
        self.register_buffer("final_norm", model.norm.weight.detach().to(dtype))
        self.eps = model.norm.eps
        self.rotary_kinds = list(model.rotaries)
        for kind, table in model.rotaries.items():
            self.register_buffer(f"cos_{kind}", table.cos.detach().clone())
            self.register_buffer(f"sin_{kind}", table.sin.detach().clone())
        self.layers = nn.ModuleList(GraphLayer(layer, dtype, int4) for layer in model.layers)

    def _mask(self, positions: torch.Tensor, seq_lens: torch.Tensor, num_keys: int, window: int | None):
        """[B, 1, 1, S, L], True where a row attends a key: cached, causal, within the window if there is one."""
        keys = torch.arange(num_keys, device=positions.device)[None, None, :]
        queries = positions[:, :, None]
        mask = (keys <= queries) & (keys < seq_lens[:, None, None])
        if window is not None:
            mask = mask & (keys > queries - window)
        return mask[:, None, None]

    def forward(self, input_ids, positions, seq_lens, kv_caches, slot_mapping=None, block_tables=None):
        x = self.embed_t.index_select(1, input_ids.reshape(-1)).t().reshape(*input_ids.shape, -1)
        if self.embed_scale != 1.0:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        rows = positions.clamp(min=0).reshape(-1)
        first = kv_caches[0]
        if isinstance(self.layout, PagedKV):
            num_keys = block_tables.shape[1] * first.shape[1]
        else:
            num_keys = first.shape[1]
            sequences = torch.arange(input_ids.shape[0], device=input_ids.device)[:, None]
            slot_mapping = torch.where(positions >= 0, sequences * num_keys + positions, -1)
        masks = {window: self._mask(positions, seq_lens, num_keys, window) for window in self.windows}
        updated = []
        for i, layer in enumerate(self.layers):
            x, k_cache, v_cache = layer(
                x,
                rows,
                getattr(self, f"cos_{layer.rotary}"),
                getattr(self, f"sin_{layer.rotary}"),
                masks[layer.window],
                kv_caches[2 * i],
                kv_caches[2 * i + 1],
                slot_mapping,
                block_tables,
                self.layout,
            )
            updated += [k_cache, v_cache]
        x = rms_norm(x, self.final_norm, self.eps)
        logits = torch.matmul(x, self.embed_t) if self.lm_head is None else nn.functional.linear(x, self.lm_head)
        logits = logits.float()
        if self.logits_scale != 1.0:
            logits = logits * self.logits_scale
        if self.final_softcap is not None:
            logits = self.final_softcap * torch.tanh(logits / self.final_softcap)
        return logits, *updated
