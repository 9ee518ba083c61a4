"""Per-request settings of a pooling model (embeddings and scores), with vLLM's names and validation."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "classify", "score")


@dataclass
class PoolingParams:
    """task: "embed" (an embedding model's vector), "classify" (a classifier's label probabilities, softmax) or
    "score" (a cross-encoder's relevance of a text pair, its activation: sigmoid for one label).
    dimensions: a Matryoshka model's vector cut to its first `dimensions` values (then normalised).
    normalize: None follows the checkpoint (sentence-transformers' Normalize module).
    truncate_prompt_tokens: keep at most this many prompt tokens (-1: max_model_len), as the tokenizer truncates."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"pooling task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")
        if self.truncate_prompt_tokens is not None and (
            not isinstance(self.truncate_prompt_tokens, int)
            or (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)
        ):
            raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {self.truncate_prompt_tokens!r}")
        if self.task != "embed" and self.dimensions is not None:
            raise ValueError(f"dimensions applies to embeddings, not to the {self.task!r} task")
