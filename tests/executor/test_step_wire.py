"""Steps sent to workers carry only what changed; the workers' copies must equal the engine's requests."""

from __future__ import annotations

from heteroserve.core.request import Request
from heteroserve.core.scheduler import ScheduledRequest, SchedulerOutput
from heteroserve.sampling_params import SamplingParams
from heteroserve.worker.step_wire import StepDecoder, StepEncoder, WireStep


def _step(*items: tuple[Request, int, list[int]]) -> SchedulerOutput:
    return SchedulerOutput([ScheduledRequest(r, n, blocks) for r, n, blocks in items])


def _same(decoded: SchedulerOutput, sent: SchedulerOutput) -> None:
    assert len(decoded.scheduled) == len(sent.scheduled)
    for got, want in zip(decoded.scheduled, sent.scheduled, strict=True):
        assert got.request.request_id == want.request.request_id
        assert got.request.token_ids == want.request.token_ids
        assert got.request.num_prompt_tokens == want.request.num_prompt_tokens
        assert got.request.sampling_params == want.request.sampling_params
        assert (got.start, got.num_new_tokens, got.block_ids, got.samples) == (
            want.start,
            want.num_new_tokens,
            want.block_ids,
            want.samples,
        )


def test_requests_travel_once_then_as_new_tokens():
    encoder, decoder = StepEncoder(), StepDecoder()
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=4))
    b = Request("b", [9, 8], SamplingParams(seed=3, max_tokens=4))

    def send(output: SchedulerOutput, released: list[str] = []) -> WireStep:  # noqa: B006 - never mutated
        wire = encoder.encode(output, released)
        decoded, gone = decoder.decode(wire)
        _same(decoded, output)
        assert gone == released
        return wire

    first = send(_step((a, 3, [0])))  # a chunk of a's prompt
    assert first.scheduled[0].prompt_token_ids == [1, 2, 3, 4, 5]
    a.num_computed_tokens = 3
    second = send(_step((a, 2, [0]), (b, 2, [1])))  # the rest of a, all of b
    assert second.scheduled[0].prompt_token_ids is None and second.scheduled[0].new_token_ids == []
    a.num_computed_tokens, b.num_computed_tokens = 5, 2
    a.append_output_token(42)
    b.append_output_token(7)
    third = send(_step((a, 1, [0]), (b, 1, [1])))
    assert [d.new_token_ids for d in third.scheduled] == [[42], [7]]
    # b is preempted (recomputed from scratch later), a finishes and its id is reused at once
    b.num_computed_tokens = 0
    a2 = Request("a", [6, 6], SamplingParams(max_tokens=1))
    fourth = send(_step((b, 3, [2]), (a2, 2, [3])), released=["a"])
    assert fourth.scheduled[1].prompt_token_ids == [6, 6]
