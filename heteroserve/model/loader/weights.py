"""Puts Hugging Face-named tensors into a `DecoderModel`, fusing q/k/v and gate/up projections."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch

from heteroserve.model.decoder import DecoderModel
from heteroserve.model.mla import LatentAttention
from heteroserve.model.moe import MoEBlock
from heteroserve.quantization.act_order import PermutedInput
from heteroserve.quantization.int4 import Int4Weight, quantize_int4
from heteroserve.quantization.int8 import Int8Weight, quantize_int8

logger = logging.getLogger(__name__)

_PROJECTIONS = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
    "q_a_proj.weight",  # latent attention's (kv_b_proj stays dense: its heads are absorbed into the queries)
    "q_b_proj.weight",
    "kv_a_proj_with_mqa.weight",
)

Weight = torch.Tensor | Int4Weight | Int8Weight | PermutedInput
INT4_GROUP = 32


def quantize_projections(
    tensors: Iterable[tuple[str, Weight]], method: str, projections: tuple[str, ...] | None = None
):
    """Round-to-nearest at load time: "int4" asymmetric per 32 input columns (projections whose input size 32
    divides), "int8" symmetric per output channel (torch's int8 kernel reads that). projections: the name
    endings of the weights to quantise (None: a decoder's)."""
    endings = projections or _PROJECTIONS
    for name, tensor in tensors:
        if not (name.endswith(endings) and isinstance(tensor, torch.Tensor)):
            yield name, tensor
        elif method == "int8":
            yield name, quantize_int8(tensor)
        elif tensor.shape[1] % INT4_GROUP == 0:
            yield name, quantize_int4(tensor, INT4_GROUP)
        else:
            yield name, tensor


def _cat(parts: list[Weight], dtype: torch.dtype) -> Weight:
    """Fuses projections that read one input. Compressed parts of one kind stay compressed; 4-bit beside 8-bit
    parts (a GGUF Q4_K_M's Q4_K q/k beside its Q6_K v) are held at 8 bits, the same values in groups that divide
    both; other mixtures (float beside compressed, differing act-orders) are dequantised to `dtype`."""
    kinds = {type(p) for p in parts}
    if kinds == {torch.Tensor}:
        return torch.cat(parts)
    if kinds == {Int4Weight, Int8Weight}:
        held = [Int8Weight.from_int4(p) if isinstance(p, Int4Weight) else p for p in parts]
        group = math.gcd(*(p.group_size for p in held))
        return Int8Weight.cat([p.regroup(group) for p in held])
    if len(kinds) == 1:
        try:
            fused = next(iter(kinds)).cat(parts)
        except ValueError:  # e.g. different group sizes
            fused = None
        if fused is not None:
            return fused
    logger.info("fused projection of %s parts dequantised to %s", "/".join(sorted(k.__name__ for k in kinds)), dtype)
    return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize(dtype) for p in parts])


def load_weights(model: DecoderModel, tensors: Iterable[tuple[str, Weight]], dtype: torch.dtype) -> None:
    """Int4 weights stay compressed (fused projections concatenate their rows); others take `dtype`."""
    found = dict(tensors)
    arch = model.arch

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in found:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        tensor = found.pop(name)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor.to(dtype) if isinstance(tensor, torch.Tensor) else tensor  # compressed ones stay so

    h, d = arch.hidden_size, arch.head_dim
    q_rows, kv_rows, inter = arch.num_heads * d, arch.num_kv_heads * d, arch.intermediate_size
    _put_linear(model, "embed_tokens", take("model.embed_tokens.weight", (arch.vocab_size, h)))
    _put(model.norm.weight, take("model.norm.weight", (h,)))
    if model.lm_head is not None:
        _put_linear(model, "lm_head", take("lm_head.weight", (arch.vocab_size, h)))
    else:
        found.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        for norm in ("input_layernorm", "post_attention_layernorm", "attn_output_norm", "mlp_output_norm"):
            if getattr(layer, norm) is not None:
                _put(getattr(layer, norm).weight, take(f"{p}{norm}.weight", (h,)))
        if isinstance(attn, LatentAttention):
            _load_latent_attention(attn, p + "self_attn.", take, arch.qk_row_order(), h)
        else:
            _load_attention(attn, p + "self_attn.", take, dtype, (q_rows, kv_rows, h))
        if layer.moe is not None:
            _load_experts(layer.moe, p + "mlp.", take, found, dtype)
            continue
        gate_up = [take(p + "mlp.gate_proj.weight", (inter, h)), take(p + "mlp.up_proj.weight", (inter, h))]
        _put_linear(layer, "gate_up_proj", _cat(gate_up, dtype))
        _put_linear(layer, "down_proj", take(p + "mlp.down_proj.weight", (h, inter)))
        if layer.gate_up_bias is not None:
            _put(layer.gate_up_bias, torch.cat([take(f"{p}mlp.{n}_proj.bias", (inter,)) for n in ("gate", "up")]))
            _put(layer.down_bias, take(p + "mlp.down_proj.bias", (h,)))
    unused = [name for name in found if "rotary_emb" not in name]
    if unused:
        raise ValueError(f"checkpoint has tensors this architecture does not use: {unused[:5]}")


def _load_attention(attn, p: str, take, dtype: torch.dtype, sizes: tuple[int, int, int]) -> None:
    """q/k/v fused into one projection, with its biases and q/k norms where the block has them."""
    q_rows, kv_rows, h = sizes
    qkv = [take(p + "q_proj.weight", (q_rows, h)), take(p + "k_proj.weight", (kv_rows, h))]
    _put_linear(attn, "qkv_proj", _cat([*qkv, take(p + "v_proj.weight", (kv_rows, h))], dtype))
    if attn.qkv_bias is not None:
        parts = (("q", q_rows), ("k", kv_rows), ("v", kv_rows))
        _put(attn.qkv_bias, torch.cat([take(f"{p}{n}_proj.bias", (rows,)) for n, rows in parts]))
    if attn.q_norm is not None:
        _put(attn.q_norm.weight, take(p + "q_norm.weight", tuple(attn.q_norm.weight.shape)))
        _put(attn.k_norm.weight, take(p + "k_norm.weight", tuple(attn.k_norm.weight.shape)))
    _put_linear(attn, "o_proj", take(p + "o_proj.weight", (h, q_rows)))
    if attn.o_bias is not None:
        _put(attn.o_bias, take(p + "o_proj.bias", (h,)))
    if attn.sinks is not None:
        _put(attn.sinks, take(p + "sinks", (attn.num_heads,)))


def _load_latent_attention(attn: LatentAttention, p: str, take, rotary_order: torch.Tensor | None, h: int) -> None:
    """Latent attention's projections; where the checkpoint's rotary pairs are adjacent, the rotary rows of the
    query (in each head, after its non-rotary rows) and of the rotary key (after the latent) are reordered as
    ModelArch.qk_row_order says, so the rotate-half tables compute the same rotation."""
    mla, heads = attn.mla, attn.num_heads
    qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim

    def rotary_rows(weight, groups: int, width: int):
        if rotary_order is None:
            return weight
        inside = torch.cat([torch.arange(width - mla.qk_rope_head_dim), width - mla.qk_rope_head_dim + rotary_order])
        return _permute_rows(weight, (torch.arange(groups)[:, None] * width + inside[None, :]).flatten())

    if mla.q_lora_rank is None:
        _put_linear(attn, "q_proj", rotary_rows(take(p + "q_proj.weight", (heads * qk_dim, h)), heads, qk_dim))
    else:
        _put_linear(attn, "q_a_proj", take(p + "q_a_proj.weight", (mla.q_lora_rank, h)))
        _put(attn.q_a_layernorm.weight, take(p + "q_a_layernorm.weight", (mla.q_lora_rank,)))
        q_b = take(p + "q_b_proj.weight", (heads * qk_dim, mla.q_lora_rank))
        _put_linear(attn, "q_b_proj", rotary_rows(q_b, heads, qk_dim))
    latent = mla.kv_lora_rank + mla.qk_rope_head_dim
    kv_a = take(p + "kv_a_proj_with_mqa.weight", (latent, h))
    _put_linear(attn, "kv_a_proj", rotary_rows(kv_a, 1, latent))
    _put(attn.kv_a_layernorm.weight, take(p + "kv_a_layernorm.weight", (mla.kv_lora_rank,)))
    kv_b = take(p + "kv_b_proj.weight", (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank))
    _put(attn.kv_b_proj, kv_b if isinstance(kv_b, torch.Tensor) else kv_b.dequantize(torch.float32))
    _put_linear(attn, "o_proj", take(p + "o_proj.weight", (h, heads * mla.v_head_dim)))


def _permute_rows(weight: Weight, rows: torch.Tensor) -> Weight:
    if isinstance(weight, torch.Tensor):
        return weight[rows]
    if not hasattr(weight, "permute_rows"):
        raise ValueError(f"{type(weight).__name__} weights cannot reorder their rows for this model's rotary")
    return weight.permute_rows(rows)


def _put(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    param.data = value.contiguous()


def _load_experts(moe: MoEBlock, prefix: str, take, found: dict, dtype: torch.dtype) -> None:
    """A mixture-of-experts MLP's router (kept in float32), its experts and its shared experts."""
    spec, h = moe.spec, moe.router.shape[1]
    moe.router.data = take(prefix + "gate.weight", (spec.num_experts, h)).float().contiguous()
    if moe.router_bias is not None:
        moe.router_bias.data = take(prefix + "gate.bias", (spec.num_experts,)).float()
    if moe.correction_bias is not None:
        name = prefix + "gate.e_score_correction_bias"
        bias = found.get(name)
        shape = (spec.num_experts,) if bias is None or bias.ndim == 1 else (1, spec.num_experts)  # ERNIE: [1, E]
        moe.correction_bias.data = take(name, shape).float().reshape(-1)
    inter = spec.intermediate_size
    for local in range(len(moe.experts_down)):
        q = f"{prefix}experts.{moe.first_expert + local}."
        gate_up = [take(q + "gate_proj.weight", (inter, h)), take(q + "up_proj.weight", (inter, h))]
        moe.experts_gate_up[local] = _cat(gate_up, dtype)
        moe.experts_down[local] = take(q + "down_proj.weight", (h, inter))
        if spec.expert_bias:
            gate_up_bias = [take(q + "gate_proj.bias", (inter,)), take(q + "up_proj.bias", (inter,))]
            moe.experts_gate_up_bias[local] = torch.cat(gate_up_bias)
            moe.experts_down_bias[local] = take(q + "down_proj.bias", (h,))
    shared = spec.shared_intermediate_size
    if shared:
        q = prefix + "shared_experts."
        gate_up = [take(q + "gate_proj.weight", (shared, h)), take(q + "up_proj.weight", (shared, h))]
        _put_linear(moe, "shared_gate_up", _cat(gate_up, dtype))
        _put_linear(moe, "shared_down", take(q + "down_proj.weight", (h, shared)))
    if moe.shared_gate is not None:
        moe.shared_gate.data = take(prefix + "shared_expert_gate.weight", (1, h)).contiguous()


def _put_linear(owner: torch.nn.Module, attr: str, value: Weight) -> None:
    """A projection's loaded value: a tensor fills the parameter, a compressed weight replaces it."""
    if not isinstance(value, torch.Tensor):
        del owner._parameters[attr]
        setattr(owner, attr, value)
    else:
        getattr(owner, attr).data = value.contiguous()
