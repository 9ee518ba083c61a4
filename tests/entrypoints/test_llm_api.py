"""The offline API: input forms, ordering, metrics, and clear errors for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from heteroserve import LLM, SamplingParams
from heteroserve.core.request import RequestStatus
from heteroserve.sampling_params import RequestOutputKind
from tests.entrypoints.test_structured_server import WEATHER


def test_prompt_forms_and_order(default_llm, default_tokenizer):
    params = SamplingParams(temperature=0, max_tokens=5)
    by_text = default_llm.generate(["Hello there", "The sky is"], params, use_tqdm=False)
    by_ids = default_llm.generate(
        [{"prompt_token_ids": default_tokenizer.encode("Hello there")}, {"prompt": "The sky is"}],
        params,
        use_tqdm=False,
    )
    single = default_llm.generate("The sky is", params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_text] == [o.outputs[0].token_ids for o in by_ids]
    assert single[0].outputs[0].text == by_text[1].outputs[0].text
    assert by_text[0].prompt == "Hello there"
    assert by_text[0].prompt_token_ids == default_tokenizer.encode("Hello there")
    metrics = by_text[0].metrics
    assert metrics.arrival_time <= metrics.first_token_time <= metrics.finished_time
    assert by_text[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts(default_llm):
    with pytest.raises(ValueError, match="max_model_len=512"):
        default_llm.generate({"prompt_token_ids": [1] * 513}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        default_llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        default_llm.generate({"prompt_token_ids": [1, 10**9]}, use_tqdm=False)
    assert not default_llm.engine.has_unfinished_requests()


def test_unknown_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="not a .gguf"):
        LLM(str(tmp_path / "notes.txt"))
    with pytest.raises(ValueError, match="not a checkpoint"):
        LLM(str(tmp_path))


def test_bad_request_does_not_disturb_the_batch(default_llm):
    engine = default_llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, output_kind=RequestOutputKind.FINAL_ONLY)
    alone = default_llm.generate(
        ["Good request one", "Good request two"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
    )
    engine.add_request("good-1", "Good request one", params)
    engine.step()
    with pytest.raises(ValueError):
        engine.add_request("bad", {"prompt_token_ids": [1] * 10_000}, params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good-1", "duplicate id", params)
    engine.add_request("good-2", "Good request two", params)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(finished) == {"good-1", "good-2"}
    assert finished["good-1"].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert finished["good-2"].outputs[0].token_ids == alone[1].outputs[0].token_ids


def test_refused_n_request_queues_no_sample(default_llm):
    """Sample i of an n > 1 request uses seed + i, so seed 2**63 - 1 is fine for sample 0 and overflows for
    sample 1; a sample id may also be taken. Either way the whole request is refused and nothing of it runs."""
    engine = default_llm.engine
    overflowing = SamplingParams(seed=2**63 - 1, n=2, max_tokens=8, ignore_eos=True)
    with pytest.raises(ValueError, match=r"n=2: sample 1 \(which uses seed \+ 1\) is invalid: seed must be"):
        default_llm.generate("hi", overflowing, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    engine.add_request("1_taken", "hi", SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="'1_taken' .sample 1 of 'taken'. is already in use"):
        engine.add_request("taken", "hi", SamplingParams(n=2, max_tokens=8))
    assert set(engine.scheduler.requests) == {"1_taken"}
    engine.abort_request("1_taken")
    engine.step()
    assert not engine.has_unfinished_requests()


def test_abort_frees_blocks_and_reports(default_llm):
    engine = default_llm.engine
    pool = engine.scheduler.kv_cache.pool
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request("keep", "Tell me a long story about dragons.", params)
    engine.add_request("drop", "Tell me a long story about knights.", params.clone(n=2))
    for _ in range(3):
        engine.step()
    assert pool.num_used_blocks > 0
    engine.abort_request("drop")
    outputs = engine.step()
    aborted = [o for o in outputs if o.request_id == "drop"]
    assert aborted and all(o.outputs[0].finish_reason == "abort" for o in aborted) and aborted[-1].finished
    while engine.has_unfinished_requests():
        engine.step()
    assert pool.num_used_blocks == 0
    assert all(b.ref_count == 0 for b in pool.blocks)


def test_priority_order():
    llm = LLM(max_model_len=128, kv_cache_memory_bytes=32 * 1024**2, max_num_seqs=1, scheduling_policy="priority")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY)
    order = []
    for rid, priority in [("low", 5), ("high", 0), ("mid", 2)]:
        engine.add_request(rid, f"Request {rid}", params, priority=priority)
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "mid", "low"]
    # A more urgent arrival preempts a running request, which then finishes with the same tokens.
    alone = llm.generate("Request low", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    engine.add_request("low2", "Request low", params.clone(max_tokens=8), priority=5)
    engine.step()
    engine.step()
    engine.add_request("urgent", "Request urgent", params, priority=0)
    order, outputs = [], {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                order.append(o.request_id)
                outputs[o.request_id] = o
    assert order == ["urgent", "low2"]
    assert outputs["low2"].metrics.num_preemptions == 1
    assert outputs["low2"].outputs[0].token_ids == alone.outputs[0].token_ids
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"


def test_chat_passes_tools_to_the_template(default_llm, default_tokenizer):
    """The tools reach the template as transformers' apply_chat_template gives them to it."""
    template = (Path(__file__).parent / "templates" / "chatml_tools.jinja").read_text()
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    out = default_llm.chat(messages, params, use_tqdm=False, chat_template=template, tools=[WEATHER])[0]
    expected = default_tokenizer.apply_chat_template(
        messages, tools=[WEATHER], chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert out.prompt == expected and '"name": "get_weather"' in out.prompt


def test_unknown_reasoning_parser_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'; known: deepseek_r1, qwen3"):
        LLM(reasoning_parser="nope")
