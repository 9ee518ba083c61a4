"""One generation request as the scheduler sees it: tokens, progress, and state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from heteroserve.lora.request import LoRARequest
from heteroserve.pooling_params import PoolingParams
from heteroserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # the request cannot go on (its grammar failed); `Request.error` says why

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass(frozen=True)
class ImagePlaceholder:
    """An image's run of placeholder tokens in the prompt; the content hash keys its KV in the prefix cache."""

    offset: int
    length: int
    content_hash: str


@dataclass(eq=False)
class Request:
    """Token ids are prompt followed by output; `num_computed_tokens` says how many have KV in the cache."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.time)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first schedule
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    error: str | None = None  # why a FINISHED_ERROR request ended
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    inter_token_gaps: list[float] = field(default_factory=list)  # between steps that appended output tokens
    finished_time: float | None = None
    prefix_leader: Request | None = None  # the n > 1 sibling whose prompt blocks this one reuses
    image_placeholders: list[ImagePlaceholder] = field(default_factory=list)
    multimodal: object | None = None  # the images as the model runner consumes them (opaque to the core)
    draft_token_ids: list[int] = field(default_factory=list)  # speculative tokens to check in the next step
    # A pooling model's request: computed whole in one step, then finished with its pooled result; no output tokens.
    pooling_params: PoolingParams | None = None
    token_type_ids: list[int] | None = None  # a cross-encoder's text-pair segments (BERT's token types)
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: the base model)
    token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def lora_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def append_output_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
