"""Puts Hugging Face-named tensors into a `DecoderModel`, fusing q/k/v and gate/up projections."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from heteroserve.model.decoder import DecoderModel
from heteroserve.quantization.int4 import Int4Weight, quantize_int4
from heteroserve.quantization.int8 import Int8Weight

_PROJECTIONS = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)

Weight = torch.Tensor | Int4Weight | Int8Weight


def quantize_projections(tensors: Iterable[tuple[str, Weight]], group_size: int = 32):
    """Round-to-nearest int4 for every projection whose input size the group divides."""
    for name, tensor in tensors:
        if name.endswith(_PROJECTIONS) and isinstance(tensor, torch.Tensor) and tensor.shape[1] % group_size == 0:
            yield name, quantize_int4(tensor, group_size)
        else:
            yield name, tensor


def _cat(parts: list[Weight]) -> Weight:
    if all(isinstance(p, Int4Weight) for p in parts):
        return Int4Weight.cat(parts)
    return torch.cat([p.dequantize() if isinstance(p, Int4Weight) else p for p in parts])


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

    def put(param: torch.nn.Parameter, value: torch.Tensor) -> None:
        param.data = value.contiguous()

    def put_linear(owner: torch.nn.Module, attr: str, value: Weight) -> None:
        if not isinstance(value, torch.Tensor):
            del owner._parameters[attr]
            setattr(owner, attr, value)
        else:
            put(getattr(owner, attr), value)

    h, d = arch.hidden_size, arch.head_dim
    q_rows, kv_rows, inter = arch.num_heads * d, arch.num_kv_heads * d, arch.intermediate_size
    put_linear(model, "embed_tokens", take("model.embed_tokens.weight", (arch.vocab_size, h)))
    put(model.norm.weight, take("model.norm.weight", (h,)))
    if model.lm_head is not None:
        put_linear(model, "lm_head", take("lm_head.weight", (arch.vocab_size, h)))
    else:
        found.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        put(layer.input_layernorm.weight, take(p + "input_layernorm.weight", (h,)))
        put(layer.post_attention_layernorm.weight, take(p + "post_attention_layernorm.weight", (h,)))
        qkv = [
            take(p + "self_attn.q_proj.weight", (q_rows, h)),
            take(p + "self_attn.k_proj.weight", (kv_rows, h)),
            take(p + "self_attn.v_proj.weight", (kv_rows, h)),
        ]
        put_linear(attn, "qkv_proj", _cat(qkv))
        if attn.qkv_bias is not None:
            put(
                attn.qkv_bias,
                torch.cat(
                    [
                        take(p + "self_attn.q_proj.bias", (q_rows,)),
                        take(p + "self_attn.k_proj.bias", (kv_rows,)),
                        take(p + "self_attn.v_proj.bias", (kv_rows,)),
                    ]
                ),
            )
        if attn.q_norm is not None:
            put(attn.q_norm.weight, take(p + "self_attn.q_norm.weight", (d,)))
            put(attn.k_norm.weight, take(p + "self_attn.k_norm.weight", (d,)))
        put_linear(attn, "o_proj", take(p + "self_attn.o_proj.weight", (h, q_rows)))
        gate_up = [take(p + "mlp.gate_proj.weight", (inter, h)), take(p + "mlp.up_proj.weight", (inter, h))]
        put_linear(layer, "gate_up_proj", _cat(gate_up))
        put_linear(layer, "down_proj", take(p + "mlp.down_proj.weight", (h, inter)))
    unused = [name for name in found if "rotary_emb" not in name]
    if unused:
        raise ValueError(f"checkpoint has tensors this architecture does not use: {unused[:5]}")
