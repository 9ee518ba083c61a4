"""Puts Hugging Face-named BERT / RoBERTa / XLM-RoBERTa tensors into an `EncoderModel`, fusing q/k/v, and takes
out a sequence classifier's head."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from heteroserve.model.encoder import EncoderModel
from heteroserve.model.layers.pooler import ClassifierHead, DenseLayer
from heteroserve.model.loader.weights import Weight, _cat

# Name endings of the projections load-time int4 / int8 quantises (the classifier head stays float).
ENCODER_PROJECTIONS = (
    ".attention.self.query.weight",
    ".attention.self.key.weight",
    ".attention.self.value.weight",
    ".attention.output.dense.weight",
    ".intermediate.dense.weight",
    ".output.dense.weight",
)
# model_type -> the classifier head's (dense, output) layers. BERT's dense is its pooler, inside the base model
# (so under its prefix, "bert."); RoBERTa's is the classifier's own.
CLASSIFIER_HEADS = {
    "bert": ("{prefix}pooler.dense", "classifier"),
    "roberta": ("classifier.dense", "classifier.out_proj"),
    "xlm-roberta": ("classifier.dense", "classifier.out_proj"),
}
_WORD_EMBEDDINGS = "embeddings.word_embeddings.weight"
# Tensors an encoder checkpoint may carry that neither the encoder nor its head reads: a masked-LM head, position
# id buffers, BERT's pooler in an embedding model.
_UNUSED = ("cls.", "lm_head.", "embeddings.position_ids", "embeddings.token_type_ids", "pooler.")


def load_encoder_weights(
    model: EncoderModel, tensors: Iterable[tuple[str, Weight]], dtype: torch.dtype, classifier: bool
) -> ClassifierHead | None:
    """Int4 / int8 projections stay compressed (q/k/v concatenate their rows); others take `dtype`. With
    `classifier`, returns the sequence-classification head in float32 (the pooler computes in float32)."""
    found = {_modern_name(name): tensor for name, tensor in tensors}
    arch = model.arch
    prefix = next((name[: -len(_WORD_EMBEDDINGS)] for name in found if name.endswith(_WORD_EMBEDDINGS)), None)
    if prefix is None:
        raise ValueError(f"checkpoint has no {_WORD_EMBEDDINGS!r}: not a {arch.model_type} encoder")

    def take(name: str, shape: tuple[int, ...], root: bool = False) -> Weight:
        key = name if root else prefix + name
        if key not in found:
            raise ValueError(f"checkpoint is missing tensor {key!r}")
        tensor = found.pop(key)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"tensor {key!r} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor.to(dtype) if isinstance(tensor, torch.Tensor) else tensor

    def put(owner: torch.nn.Module, attr: str, value: Weight) -> None:
        if isinstance(value, torch.Tensor):
            getattr(owner, attr).data = value.contiguous()
        else:  # a compressed weight, kept as a plain attribute until prepare_weights
            del owner._parameters[attr]
            setattr(owner, attr, value)

    def put_norm(norm: torch.nn.LayerNorm, name: str) -> None:
        put(norm, "weight", take(name + ".weight", (h,)))
        put(norm, "bias", take(name + ".bias", (h,)))

    h, inter = arch.hidden_size, arch.intermediate_size
    put(model, "word_embeddings", take("embeddings.word_embeddings.weight", (arch.vocab_size, h)))
    put(model, "position_embeddings", take("embeddings.position_embeddings.weight", (arch.max_position_embeddings, h)))
    put(model, "token_type_embeddings", take("embeddings.token_type_embeddings.weight", (arch.type_vocab_size, h)))
    put_norm(model.embed_norm, "embeddings.LayerNorm")
    for i, layer in enumerate(model.layers):
        p = f"encoder.layer.{i}."
        parts = ("query", "key", "value")
        put(layer, "qkv_proj", _cat([take(f"{p}attention.self.{n}.weight", (h, h)) for n in parts], dtype))
        put(layer, "qkv_bias", torch.cat([take(f"{p}attention.self.{n}.bias", (h,)) for n in parts]))
        put(layer, "o_proj", take(p + "attention.output.dense.weight", (h, h)))
        put(layer, "o_bias", take(p + "attention.output.dense.bias", (h,)))
        put_norm(layer.attn_norm, p + "attention.output.LayerNorm")
        put(layer, "up_proj", take(p + "intermediate.dense.weight", (inter, h)))
        put(layer, "up_bias", take(p + "intermediate.dense.bias", (inter,)))
        put(layer, "down_proj", take(p + "output.dense.weight", (h, inter)))
        put(layer, "down_bias", take(p + "output.dense.bias", (h,)))
        put_norm(layer.ffn_norm, p + "output.LayerNorm")
    head = None
    if classifier:
        dense_name, out_name = (name.format(prefix=prefix) for name in CLASSIFIER_HEADS[arch.model_type])
        dense = _dense(found, dense_name, "tanh")
        if out_name + ".weight" not in found:
            raise ValueError(f"checkpoint is missing the classifier head {out_name!r}")
        head = ClassifierHead(_dense(found, out_name, "identity"), dense)
    unused = [name for name in found if not name.removeprefix(prefix).startswith(_UNUSED)]
    if unused:
        raise ValueError(f"checkpoint has tensors this encoder does not use: {unused[:5]}")
    return head


def _dense(found: dict[str, Weight], name: str, activation: str) -> DenseLayer:
    weight = found.pop(name + ".weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"checkpoint is missing the classifier head tensor {name + '.weight'!r}")
    bias = found.pop(name + ".bias", None)
    return DenseLayer(weight.float(), None if bias is None else bias.float(), activation)


def _modern_name(name: str) -> str:
    """Old TensorFlow-converted BERT checkpoints name LayerNorm parameters gamma / beta."""
    return name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
