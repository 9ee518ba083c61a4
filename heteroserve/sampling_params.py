"""Per-request sampling settings, with vLLM's names and validation."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import Enum

from heteroserve.structured_output.params import StructuredOutputsParams

_GREEDY_BELOW = 1e-5
_INT64 = 2**63


class RequestOutputKind(Enum):
    """What `LLMEngine.step` reports for a request: all text so far, only the new part, or only the end."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # words never generated (the engine fills bad_words_token_ids)
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # guided decoding: the output matches this
    stop_strings: list[str] = field(init=False, repr=False)
    # Each bad word's token sequences (with and without a leading space): the engine tokenizes, workers apply.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_strings = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = _token_keys(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, value: object, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, ">= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "an integer >= 0, or -1 to disable")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "> 0")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if self.seed is not None and not -_INT64 <= self.seed < _INT64:
            raise bad("seed", self.seed, "a 64-bit integer")
        if any(not 0 <= t < _INT64 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "token ids >= 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", self.min_tokens, ">= 0 and <= max_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise bad(name, value, "an integer >= 0")
        if self.logit_bias is not None and any(t < 0 or not -100 <= b <= 100 for t, b in self.logit_bias.items()):
            raise bad("logit_bias", self.logit_bias, "token ids >= 0 mapped to biases in [-100, 100]")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list of token ids >= 0")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)
        ):
            raise bad("bad_words", self.bad_words, "a list of words (non-blank strings)")

    @property
    def greedy(self) -> bool:
        """Temperatures this small would overflow the scaled logits; vLLM treats them as greedy too."""
        return self.temperature < _GREEDY_BELOW

    def clone(self, **changes: object) -> SamplingParams:
        params = copy.copy(self)
        for key, value in changes.items():
            setattr(params, key, value)
        params.__post_init__()  # re-normalises (new stop_strings, stop_token_ids lists) and validates
        return params


def _token_keys(bias: dict) -> dict[int, float]:
    """logit_bias with integer token ids as keys: OpenAI's JSON sends them as strings ("50256")."""
    try:
        return {int(str(token)): float(value) for token, value in bias.items()}
    except (AttributeError, TypeError, ValueError) as exc:
        raise ValueError(f"logit_bias must be a map of token ids to numbers, got {bias!r}") from exc
