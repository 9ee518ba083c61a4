"""A loaded pooling model run directly on tokenized inputs, without the engine: the model-level tests' harness."""

from __future__ import annotations

import torch

from heteroserve.model.encoder import EncoderModel
from heteroserve.model.loader import LoadedModel
from heteroserve.platforms.attention import AttentionStep
from heteroserve.pooling_params import PoolingParams

BLOCK_SIZE = 16


def tokenize(loaded: LoadedModel, texts: list[str] | list[tuple[str, str]]) -> list[dict[str, list[int]]]:
    """Each text (or pair) as the tokenizer encodes it: input_ids and token_type_ids (zeros where it has none)."""
    encoded = []
    for text in texts:
        enc = loaded.tokenizer(*text) if isinstance(text, tuple) else loaded.tokenizer(text)
        ids = list(enc["input_ids"])
        encoded.append({"input_ids": ids, "token_type_ids": list(enc.get("token_type_ids") or [0] * len(ids))})
    return encoded


@torch.inference_mode()
def hidden_states(loaded: LoadedModel, encoded: list[dict[str, list[int]]]) -> torch.Tensor:
    """The model's last hidden states [T, hidden] for the sequences flattened in one forward pass."""
    ids = torch.tensor([t for e in encoded for t in e["input_ids"]])
    positions = torch.tensor([p for e in encoded for p in range(len(e["input_ids"]))])
    seq_lens = [len(e["input_ids"]) for e in encoded]
    if isinstance(loaded.model, EncoderModel):
        types = torch.tensor([t for e in encoded for t in e["token_type_ids"]])
        return loaded.model(ids, types, positions, seq_lens)
    return _decoder_hidden(loaded, ids, positions, seq_lens)


def _decoder_hidden(loaded: LoadedModel, ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int]):
    """A decoder's prefill of every sequence from position 0, each in its own blocks of a scratch KV cache."""
    arch = loaded.model.arch
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    shape = (sum(blocks), BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
    dtype = loaded.dtype
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in loaded.model.layers]
    requests, first_block = [], 0
    for n, count in zip(seq_lens, blocks, strict=True):
        requests.append((list(range(first_block, first_block + count)), 0, n))
        first_block += count
    backend = loaded.model.attn_backend
    meta = {
        w: backend.build_metadata(AttentionStep.of(BLOCK_SIZE, requests, 0, w, "cpu")) for w in arch.sliding_windows
    }
    return loaded.model(ids, positions, caches, meta)


def pooled(
    loaded: LoadedModel, texts: list[str] | list[tuple[str, str]], params: PoolingParams | list[PoolingParams]
) -> torch.Tensor:
    """The pooler's results for the texts, all in one forward pass, stacked [n, size]."""
    encoded = tokenize(loaded, texts)
    hidden = hidden_states(loaded, encoded)
    params = params if isinstance(params, list) else [params] * len(texts)
    return torch.stack(loaded.pooler.pool(hidden, [len(e["input_ids"]) for e in encoded], params))
