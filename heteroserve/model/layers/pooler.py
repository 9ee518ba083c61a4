"""Pooling models' heads: what a sequence's hidden states become (an embedding, a classifier's output)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from heteroserve.pooling_params import PoolingParams


@dataclass(frozen=True)
class ChatTemplateInput:
    """A sentence-transformers 6 Transformer module with a "message" modality: each text reaches the model as a
    user message rendered through the tokenizer's chat template (a cross-encoder's pair as a "query" and a
    "document" message), and a prompt as a system message before it.

    structured: message content as [{"type": "text", "text": ...}] rather than the bare string ("flat").
    template_kwargs: processing_kwargs["chat_template"], passed to apply_chat_template (add_generation_prompt, ...).
    restore_suffix: after truncation, the template's closing tokens are written back over the last ones."""

    structured: bool
    template_kwargs: dict[str, object] = field(default_factory=dict)
    restore_suffix: bool = True


@dataclass(frozen=True)
class PoolerSpec:
    """What the engine and the server need to know of a pooling model (the worker holds the weights).

    task: "embed" (an embedding model) or "score" (a cross-encoder / classifier with a head).
    pooling_type: "CLS", "MEAN" or "LAST". normalize: the default of embeddings (sentence-transformers' Normalize).
    embedding_size: the length of an embedding (after any Dense layers); for "score", the head's input size.
    matryoshka_dimensions: None when the model is not Matryoshka-trained (`dimensions` is refused), () when any
    size up to embedding_size is allowed, else the allowed sizes.
    num_labels: the classifier head's outputs ("score" models). activation: what turns them into a score
    ("sigmoid" or "identity", sentence-transformers' CrossEncoder activation_fn).
    prompts: sentence-transformers' named instruction prefixes (config_sentence_transformers.json "prompts").
    default_prompt: the prompt sentence-transformers applies to every text when none is named (its
    default_prompt_name), None for none.
    lowercase: texts are lowercased before tokenizing (sentence_bert_config.json's do_lower_case).
    chat_template: how texts go through the chat template (sentence_bert_config.json's modality_config.message);
    None: texts are tokenized as they are."""

    task: str
    pooling_type: str
    normalize: bool
    embedding_size: int
    matryoshka_dimensions: tuple[int, ...] | None = None
    num_labels: int = 0
    activation: str = "identity"
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt: str | None = None
    lowercase: bool = False
    chat_template: ChatTemplateInput | None = None

    def check(self, params: PoolingParams) -> None:
        """ValueError naming what a request asks that this model cannot do."""
        tasks = {"embed": ("embed",), "score": ("score", "classify")}[self.task]
        if params.task not in tasks:
            kind = "an embedding model" if self.task == "embed" else "a cross-encoder (scores text pairs)"
            raise ValueError(f"this is {kind}: the {params.task!r} task is not available")
        if params.dimensions is not None:
            if self.matryoshka_dimensions is None:
                raise ValueError("dimensions: this model does not support Matryoshka representations")
            if params.dimensions > self.embedding_size:
                raise ValueError(f"dimensions {params.dimensions} exceeds the embedding size {self.embedding_size}")
            if self.matryoshka_dimensions and params.dimensions not in self.matryoshka_dimensions:
                allowed = ", ".join(map(str, self.matryoshka_dimensions))
                raise ValueError(f"dimensions {params.dimensions} is not one of this model's sizes: {allowed}")


# sentence-transformers' Dense activation_function (a torch.nn class path) -> what it computes.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda x: x,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
    "gelu": F.gelu,
}


@dataclass
class DenseLayer:
    """A sentence-transformers Dense module: activation(x W^T + b), after pooling."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None
    activation: str = "identity"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return ACTIVATIONS[self.activation](F.linear(x, self.weight, self.bias))


@dataclass
class ClassifierHead:
    """A sequence classifier's head on the pooled row: tanh(x D^T + d) (BERT's pooler, RoBERTa's classifier.dense),
    then the output projection to the labels; decoder classifiers have only the projection (dense None)."""

    out: DenseLayer
    dense: DenseLayer | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x if self.dense is None else self.dense(x))


class Pooler:
    """Turns a step's hidden states into one result per sequence: an embedding (pooled, through the Dense layers,
    cut to the requested dimensions, then L2-normalised) or a classifier's scores. Everything is computed for all of
    the step's sequences at once, in float32 on the hidden states' device; results come back as CPU tensors."""

    def __init__(self, spec: PoolerSpec, dense: list[DenseLayer] | None = None, head: ClassifierHead | None = None):
        if spec.task == "score" and head is None:
            raise ValueError("a score model needs its classifier head")
        self.spec = spec
        self.dense = dense or []
        self.head = head

    def pool(self, hidden: torch.Tensor, seq_lens: list[int], params: list[PoolingParams]) -> list[torch.Tensor]:
        """hidden [T, H]: the sequences' rows, flattened in order (seq_lens of them). One float32 CPU tensor per
        sequence: [size] for embeddings, [num_labels] for scores."""
        if len(seq_lens) != len(params):
            raise ValueError(f"{len(seq_lens)} sequences but {len(params)} pooling params")
        pooled = self._pooled_rows(hidden, seq_lens)
        if self.spec.task == "score":
            return self._scores(pooled, params)
        for layer in self.dense:
            pooled = layer(pooled)
        return self._embeddings(pooled, params)

    def _pooled_rows(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        lens = torch.tensor(seq_lens, device=hidden.device)
        ends = lens.cumsum(0)
        kind = self.spec.pooling_type
        if kind == "CLS":
            return hidden[ends - lens].float()
        if kind == "LAST":
            return hidden[ends - 1].float()
        if kind == "MEAN":
            which = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden.device), lens)
            sums = hidden.new_zeros((len(seq_lens), hidden.shape[1]), dtype=torch.float32)
            sums.index_add_(0, which, hidden.float())
            return sums / lens[:, None]
        raise ValueError(f"unknown pooling type {kind!r}")

    def _embeddings(self, pooled: torch.Tensor, params: list[PoolingParams]) -> list[torch.Tensor]:
        size = pooled.shape[1]
        dims = [p.dimensions or size for p in params]
        normalize = [self.spec.normalize if p.normalize is None else p.normalize for p in params]
        if any(normalize):
            # Each row's norm over its own first dims[i] values (normalised after the cut, as OpenAI does).
            kept = torch.arange(size, device=pooled.device)[None, :] < torch.tensor(dims, device=pooled.device)[:, None]
            norms = (pooled * kept).norm(dim=1, keepdim=True).clamp_min(1e-12)
            scale = torch.where(torch.tensor(normalize, device=pooled.device)[:, None], norms, 1.0)
            pooled = pooled / scale
        rows = pooled.cpu()
        return [row[:d].clone() for row, d in zip(rows, dims, strict=True)]

    def _scores(self, pooled: torch.Tensor, params: list[PoolingParams]) -> list[torch.Tensor]:
        logits = self.head(pooled)
        activated = ACTIVATIONS[self.spec.activation](logits)
        if any(p.task == "classify" for p in params):
            probabilities = logits.softmax(dim=-1)
            classify = torch.tensor([p.task == "classify" for p in params], device=logits.device)[:, None]
            activated = torch.where(classify, probabilities, activated)
        return list(activated.cpu().unbind(0))
