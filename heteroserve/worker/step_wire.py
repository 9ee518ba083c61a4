"""Steps as every rank receives them (in the engine's process, worker processes, Ray actors): only what changed
since the last step.

A request's prompt and sampling parameters go once, when it is first scheduled; afterwards a step carries
the tokens appended since (the last sampled one), where its computation starts, and its block table. The
workers keep their own copy of each request until the engine releases it. Sending whole requests instead
would cost every step time proportional to every running request's length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from heteroserve.core.request import Request
from heteroserve.core.scheduler import ScheduledRequest, SchedulerOutput
from heteroserve.lora.request import LoRARequest
from heteroserve.pooling_params import PoolingParams
from heteroserve.sampling_params import SamplingParams


@dataclass
class ScheduledDelta:
    request_id: str
    new_token_ids: list[int]  # appended since the request was last sent (all output tokens the first time)
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int]
    prompt_token_ids: list[int] | None = None  # the first time only
    sampling_params: SamplingParams | None = None  # the first time only
    draft_token_ids: list[int] = field(default_factory=list)  # speculative tokens to check this step
    pooling_params: PoolingParams | None = None  # the first time only
    token_type_ids: list[int] | None = None  # the first time only
    multimodal: object | None = None  # the first time only: a vision-language prompt's images (one rank only)
    lora_request: LoRARequest | None = None  # the first time only


@dataclass
class WireStep:
    scheduled: list[ScheduledDelta]
    released: list[str] = field(default_factory=list)  # finished since the last step: forget them
    # Structured outputs: request id -> its grammar's bitmask row. A worker process gets them computed (the engine
    # waits for them before sending); the rank in the engine's process gets the Future, so they are computed
    # while its model runs.
    token_bitmasks: Mapping[str, Sequence[int]] | Future | None = None


class StepEncoder:
    """The engine's side: remembers how many tokens of each request the workers already have."""

    def __init__(self) -> None:
        self._sent: dict[str, int] = {}

    def encode(self, output: SchedulerOutput, released: list[str], wait_for_masks: bool = True) -> WireStep:
        for request_id in released:
            self._sent.pop(request_id, None)
        deltas = []
        for item in output.scheduled:
            request = item.request
            sent = self._sent.get(request.request_id)
            first = sent is None
            delta = ScheduledDelta(
                request.request_id,
                request.token_ids[request.num_prompt_tokens if first else sent :],
                request.num_computed_tokens,
                item.num_new_tokens,
                item.block_ids,
                request.prompt_token_ids if first else None,
                request.sampling_params if first else None,
                item.draft_token_ids,
                request.pooling_params if first else None,
                request.token_type_ids if first else None,
                request.multimodal if first else None,
                request.lora_request if first else None,
            )
            self._sent[request.request_id] = request.num_tokens
            deltas.append(delta)
        masks = output.token_bitmasks
        if wait_for_masks and masks is not None:
            masks = masks.result()
        return WireStep(deltas, released, masks)


class StepDecoder:
    """The worker's side: rebuilds the scheduler's output from its copies of the requests."""

    def __init__(self) -> None:
        self._requests: dict[str, Request] = {}

    def decode(self, step: WireStep) -> tuple[SchedulerOutput, list[str]]:
        for request_id in step.released:
            self._requests.pop(request_id, None)
        scheduled = []
        for delta in step.scheduled:
            if delta.prompt_token_ids is not None:
                request = Request(
                    delta.request_id,
                    delta.prompt_token_ids,
                    delta.sampling_params,
                    pooling_params=delta.pooling_params,
                    token_type_ids=delta.token_type_ids,
                    multimodal=delta.multimodal,
                    lora_request=delta.lora_request,
                )
                self._requests[delta.request_id] = request
            request = self._requests[delta.request_id]
            request.token_ids.extend(delta.new_token_ids)
            request.num_computed_tokens = delta.num_computed_tokens
            scheduled.append(ScheduledRequest(request, delta.num_new_tokens, delta.block_ids, delta.draft_token_ids))
        masks = step.token_bitmasks
        if masks is not None and not isinstance(masks, Future):
            masks = Future()
            masks.set_result(step.token_bitmasks)
        return SchedulerOutput(scheduled, token_bitmasks=masks), step.released
