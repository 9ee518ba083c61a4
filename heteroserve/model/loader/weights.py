"""Puts Hugging Face-named tensors into a `DecoderModel`, fusing q/k/v and gate/up projections."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from heteroserve.model.decoder import DecoderModel


def load_weights(model: DecoderModel, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
    found = dict(tensors)
    arch = model.arch

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in found:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        tensor = found.pop(name)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor.to(dtype)

    def put(param: torch.nn.Parameter | None, value: torch.Tensor) -> None:
        param.data = value.contiguous()

    h, d = arch.hidden_size, arch.head_dim
    q_rows, kv_rows, inter = arch.num_heads * d, arch.num_kv_heads * d, arch.intermediate_size
    put(model.embed_tokens, take("model.embed_tokens.weight", (arch.vocab_size, h)))
    put(model.norm.weight, take("model.norm.weight", (h,)))
    if model.lm_head is not None:
        put(model.lm_head, take("lm_head.weight", (arch.vocab_size, h)))
    else:
        found.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        put(layer.input_layernorm.weight, take(p + "input_layernorm.weight", (h,)))
        put(layer.post_attention_layernorm.weight, take(p + "post_attention_layernorm.weight", (h,)))
        put(
            attn.qkv_proj,
            torch.cat(
                [
                    take(p + "self_attn.q_proj.weight", (q_rows, h)),
                    take(p + "self_attn.k_proj.weight", (kv_rows, h)),
                    take(p + "self_attn.v_proj.weight", (kv_rows, h)),
                ]
            ),
        )
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
        put(attn.o_proj, take(p + "self_attn.o_proj.weight", (h, q_rows)))
        put(
            layer.gate_up_proj,
            torch.cat(
                [
                    take(p + "mlp.gate_proj.weight", (inter, h)),
                    take(p + "mlp.up_proj.weight", (inter, h)),
                ]
            ),
        )
        put(layer.down_proj, take(p + "mlp.down_proj.weight", (h, inter)))
    unused = [name for name in found if "rotary_emb" not in name]
    if unused:
        raise ValueError(f"checkpoint has tensors this architecture does not use: {unused[:5]}")
