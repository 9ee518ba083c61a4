"""One bidirectional encoder for BERT, RoBERTa and XLM-RoBERTa (embedding models, cross-encoders); the differences
are in `EncoderArch`.

As in the decoder, the tokens of a step's sequences arrive flattened ([T] ids, token types and 0-based positions),
so each projection is one matrix product over the step through the platform's linear operator (load-time int4 /
int8 and the CPU's packed GEMM apply). There is no KV cache: a sequence is always computed whole, and attends to
all of its own tokens and to no other sequence's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from heteroserve.model.decoder import stored_weight_bytes
from heteroserve.platforms.operators import OperatorTable

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")
# These number positions from padding_idx + 1 (fairseq's layout); BERT from 0.
_POSITIONS_AFTER_PADDING = ("roberta", "xlm-roberta")


@dataclass(frozen=True)
class EncoderArch:
    """What differs between the encoders, read from the Hugging Face config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    position_offset: int  # added to 0-based positions: padding_idx + 1 for RoBERTa / XLM-R, 0 for BERT
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> EncoderArch:
        model_type = config.model_type
        if model_type not in ENCODER_TYPES:
            raise ValueError(f"unsupported encoder {model_type!r}; supported: {', '.join(ENCODER_TYPES)}")
        act = getattr(config, "hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"unsupported encoder activation {act!r}; only exact gelu is implemented")
        position_type = getattr(config, "position_embedding_type", "absolute") or "absolute"
        if position_type != "absolute":
            raise ValueError(f"unsupported position_embedding_type {position_type!r}; only absolute is implemented")
        offset = config.pad_token_id + 1 if model_type in _POSITIONS_AFTER_PADDING else 0
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            head_dim=config.hidden_size // config.num_attention_heads,
            intermediate_size=config.intermediate_size,
            max_position_embeddings=config.max_position_embeddings,
            position_offset=offset,
            type_vocab_size=config.type_vocab_size,
            layer_norm_eps=config.layer_norm_eps,
        )

    @property
    def max_model_len(self) -> int:
        """The longest sequence the position table holds."""
        return self.max_position_embeddings - self.position_offset


@dataclass
class SequenceLayout:
    """Where each sequence of a step lies among the flattened tokens. Attention runs sequence by sequence through
    the platform's bidirectional attention (on the CPU our prefill kernel on the GEMM tile, with every key
    visible): no padding to compute, where torch's scaled_dot_product_attention over neighbours of similar length
    padded into one call spends arithmetic on the pads (bench/README.md, "Figures behind the code's choices")."""

    rows: list[slice]

    @classmethod
    def of(cls, seq_lens: list[int]) -> SequenceLayout:
        rows = []
        start = 0
        for n in seq_lens:
            rows.append(slice(start, start + n))
            start += n
        return cls(rows)

    def attend(self, qkv: torch.Tensor, scale: float, ops: OperatorTable) -> torch.Tensor:
        """qkv [T, 3, heads, head_dim] -> [T, heads * head_dim]: each sequence's tokens attend to all of its own."""
        t, _, heads, head_dim = qkv.shape
        out = qkv.new_empty(t, heads * head_dim)
        for rows in self.rows:
            q, k, v = qkv[rows].unbind(1)
            out[rows] = ops.bidirectional_attention(q, k, v, scale).flatten(1)
        return out


def _weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape), requires_grad=False)


class EncoderLayer(nn.Module):
    """Post-norm: x = LN(x + attention(x)); x = LN(x + FFN(x))."""

    def __init__(self, arch: EncoderArch, ops: OperatorTable) -> None:
        super().__init__()
        h = arch.hidden_size
        self.ops = ops
        self.linear = ops.linear
        self.num_heads, self.head_dim = arch.num_heads, arch.head_dim
        self.qkv_proj = _weight(3 * h, h)
        self.qkv_bias = _weight(3 * h)
        self.o_proj = _weight(h, h)
        self.o_bias = _weight(h)
        self.attn_norm = nn.LayerNorm(h, arch.layer_norm_eps)
        self.up_proj = _weight(arch.intermediate_size, h)
        self.up_bias = _weight(arch.intermediate_size)
        self.down_proj = _weight(h, arch.intermediate_size)
        self.down_bias = _weight(h)
        self.ffn_norm = nn.LayerNorm(h, arch.layer_norm_eps)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        qkv = self.linear(x, self.qkv_proj, self.qkv_bias).view(-1, 3, self.num_heads, self.head_dim)
        out = layout.attend(qkv, self.scale, self.ops)
        x = self.attn_norm(x + self.linear(out, self.o_proj, self.o_bias))
        up = F.gelu(self.linear(x, self.up_proj, self.up_bias))
        return self.ffn_norm(x + self.linear(up, self.down_proj, self.down_bias))


class EncoderModel(nn.Module):
    """Embeddings (word + position + token type, normalised), then the post-norm layers; the pooler reads the last
    hidden states."""

    def __init__(self, arch: EncoderArch, ops: OperatorTable) -> None:
        super().__init__()
        self.arch = arch
        self.ops = ops
        h = arch.hidden_size
        self.word_embeddings = _weight(arch.vocab_size, h)
        self.position_embeddings = _weight(arch.max_position_embeddings, h)
        self.token_type_embeddings = _weight(arch.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, arch.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(arch, ops) for _ in range(arch.num_layers))
        self.requires_grad_(False)

    def prepare_weights(self) -> None:
        """Hands every projection weight to the linear kernel once (repacking); call after loading."""
        for layer in self.layers:
            for name in ("qkv_proj", "o_proj", "up_proj", "down_proj"):
                weight = getattr(layer, name)
                prepared = self.ops.linear.prepare(weight.data if isinstance(weight, torch.Tensor) else weight)
                layer._parameters.pop(name, None)
                if isinstance(prepared, torch.Tensor):
                    setattr(layer, name, nn.Parameter(prepared, requires_grad=False))
                else:  # a compressed or packed weight object, kept as a plain attribute
                    setattr(layer, name, prepared)

    def weight_bytes(self) -> int:
        """Bytes of all weights as stored (stored_weight_bytes)."""
        return stored_weight_bytes(self)

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int]
    ) -> torch.Tensor:
        """The last layer's hidden states [T, hidden] of the sequences whose tokens are flattened in input_ids
        (seq_lens of them, in order); positions are 0-based within each sequence."""
        if sum(seq_lens) != input_ids.shape[0]:
            raise ValueError(f"seq_lens add up to {sum(seq_lens)} tokens, but {input_ids.shape[0]} arrived")
        x = (
            F.embedding(input_ids, self.word_embeddings)
            + F.embedding(positions + self.arch.position_offset, self.position_embeddings)
            + F.embedding(token_type_ids, self.token_type_embeddings)
        )
        x = self.embed_norm(x)
        layout = SequenceLayout.of(seq_lens)
        for layer in self.layers:
            x = layer(x, layout)
        return x
