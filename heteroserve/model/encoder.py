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


# A group of sequences padded to its longest may cost at most this much more attention work than the sequences
# alone (sum of squared lengths).
PADDING_SLACK = 1.25


@dataclass
class _Group:
    """Sequences attended in one scaled_dot_product_attention call."""

    rows: slice | torch.Tensor  # the group's tokens in the flattened step
    padded_rows: torch.Tensor | None  # where they sit in the [B * L] padded batch; None: one sequence, unpadded
    num_seqs: int
    max_len: int
    key_mask: torch.Tensor | None  # [B, 1, 1, L] True where a key is a real token; None: no padding


@dataclass
class SequenceLayout:
    """How a step's sequences are grouped for attention.

    Sorted by length, neighbours join a group while padding them to its longest adds at most PADDING_SLACK of
    work: one call per sequence pays a fixed overhead that dominates short sequences, one padded call over the
    whole step wastes work on mixed lengths. A 12-layer forward over 16 sequences of 32-512 tokens on 2 cores took
    137 ms grouped, 271 ms one call per sequence, 195 ms one padded call (hidden 64, 4 heads; at hidden 384, 6
    heads: 1044, 1050, 1227 ms)."""

    groups: list[_Group]

    @classmethod
    def of(cls, seq_lens: list[int], device: torch.device) -> SequenceLayout:
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        members: list[list[int]] = []
        squares = 0
        for i in sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i]):
            n = seq_lens[i]
            group = members[-1] if members else None
            if group is None or (len(group) + 1) * seq_lens[group[0]] ** 2 > PADDING_SLACK * (squares + n * n):
                members.append([i])
                squares = n * n
            else:
                group.append(i)
                squares += n * n
        groups = []
        for group in members:
            width = seq_lens[group[0]]
            if len(group) == 1:
                groups.append(_Group(slice(starts[group[0]], starts[group[0] + 1]), None, 1, width, None))
                continue
            lengths = torch.tensor([seq_lens[i] for i in group], device=device)
            index = torch.arange(width, device=device)
            real = index[None, :] < lengths[:, None]  # [B, L]
            rows = torch.cat([torch.arange(starts[i], starts[i + 1], device=device) for i in group])
            padded_rows = (torch.arange(len(group), device=device)[:, None] * width + index[None, :])[real]
            mask = None if bool(real.all()) else real[:, None, None, :]
            groups.append(_Group(rows, padded_rows, len(group), width, mask))
        return cls(groups)

    def attend(self, qkv: torch.Tensor, scale: float) -> torch.Tensor:
        """qkv [T, 3, heads, head_dim] -> [T, heads * head_dim]: each sequence's tokens attend to all of its own."""
        t, _, heads, head_dim = qkv.shape
        out = qkv.new_empty(t, heads * head_dim)
        for g in self.groups:
            if g.padded_rows is None:
                q, k, v = qkv[g.rows].permute(1, 2, 0, 3)  # each [heads, n, head_dim]
                out[g.rows] = F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1).flatten(1)
                continue
            padded = qkv.new_zeros(g.num_seqs * g.max_len, 3, heads, head_dim)
            padded[g.padded_rows] = qkv[g.rows]
            q, k, v = padded.view(g.num_seqs, g.max_len, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=g.key_mask, scale=scale)
            out[g.rows] = attended.transpose(1, 2).flatten(2).flatten(0, 1)[g.padded_rows]
        return out


def _weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape), requires_grad=False)


class EncoderLayer(nn.Module):
    """Post-norm: x = LN(x + attention(x)); x = LN(x + FFN(x))."""

    def __init__(self, arch: EncoderArch, ops: OperatorTable) -> None:
        super().__init__()
        h = arch.hidden_size
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
        out = layout.attend(qkv, self.scale)
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
        layout = SequenceLayout.of(seq_lens, x.device)
        for layer in self.layers:
            x = layer(x, layout)
        return x
