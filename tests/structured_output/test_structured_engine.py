"""Structured outputs through the offline engine on the default model: a 135M model that does not follow
instructions still writes schema-valid JSON, matches regexes and picks choices, whatever else shares its batch,
sampled or greedy, n > 1, after preemption, with prefix caching and next to speculative requests."""

from __future__ import annotations

import json

import jsonschema
import pytest
import regex

from heteroserve import LLM, SamplingParams
from heteroserve.structured_output import StructuredOutputsParams

ENGINE_KWARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 128 * 1024**2}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "pets", "address"],
    "additionalProperties": False,
}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
CHAT = [{"role": "user", "content": "Tell me about someone you know."}]


def structured(kind: str, value, **kwargs) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(**{kind: value}), **kwargs)


def check_person(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


def test_constraints_of_every_kind_in_one_batch(default_llm):
    params = [
        structured("json", PERSON, temperature=0, max_tokens=120),
        structured("json", PERSON, temperature=1.0, seed=7, n=3, max_tokens=120),
        structured("regex", DATE, temperature=1.0, seed=3, max_tokens=20),
        structured("choice", ["yes", "no", "it depends"], temperature=0, max_tokens=10),
        structured(
            "grammar", 'start: "(" num (" + " num)* ")"\nnum: /[1-9][0-9]?/', temperature=0.8, seed=1, max_tokens=40
        ),
        structured("json_object", True, temperature=0, max_tokens=80),
        SamplingParams(temperature=0, max_tokens=16),  # unconstrained, in the same steps
    ]
    outputs = default_llm.chat([CHAT] * len(params), params, use_tqdm=False)
    for completion in outputs[0].outputs + outputs[1].outputs:
        assert completion.finish_reason == "stop"
        check_person(completion.text)
    assert len({c.text for c in outputs[1].outputs}) > 1  # sampled: the three children differ
    assert regex.fullmatch(DATE, outputs[2].outputs[0].text)
    assert outputs[3].outputs[0].text in ("yes", "no", "it depends")
    assert regex.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", outputs[4].outputs[0].text)
    assert isinstance(json.loads(outputs[5].outputs[0].text), dict)
    free = outputs[6].outputs[0].text
    assert (
        free
        == default_llm.chat([CHAT], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    )


def test_a_grammar_cut_by_max_tokens_finishes_with_length(default_llm):
    out = default_llm.chat([CHAT], structured("json", PERSON, temperature=0, max_tokens=5), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 5
    assert completion.text.startswith("{")


def test_a_bad_schema_is_refused_before_anything_is_queued(default_llm):
    bad = structured("json", {"type": "object", "properties": {"a": {"type": "nonsense"}}})
    with pytest.raises(ValueError, match="invalid json"):
        default_llm.engine.add_request("bad", "hi", bad)
    n_bad = structured("regex", "[a-", n=2)
    with pytest.raises(ValueError, match="invalid regex"):
        default_llm.engine.add_request("bad-n", "hi", n_bad)
    assert not default_llm.engine.has_unfinished_requests()


def test_stop_strings_cut_a_structured_output(default_llm):
    params = structured("regex", "alpha;beta;gamma", temperature=0, max_tokens=20, stop=[";g"])
    assert default_llm.generate(["List:"], params, use_tqdm=False)[0].outputs[0].text == "alpha;beta"


def test_preemption_and_prefix_caching_keep_the_grammar():
    """A KV cache of 24 blocks of 16 tokens for 6 requests growing past 60 tokens each: requests are preempted
    and recomputed, with their matchers kept; the shared chat prefix comes from the prefix cache."""
    llm = LLM(max_model_len=256, num_kv_blocks=24, block_size=16, seed=5)
    params = structured("json", PERSON, temperature=1.0, seed=11, max_tokens=120)
    outputs = llm.chat([CHAT] * 6, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hits > 0
    for out in outputs:
        check_person(out.outputs[0].text)
    assert llm.engine.scheduler.kv_cache.usage == 0


@pytest.mark.parametrize(
    ("quantization", "speculative"),
    [
        (None, {"method": "ngram", "num_speculative_tokens": 4}),
        ("none", {"model": "self-int4", "num_speculative_tokens": 4}),  # the float model, its Q4_1 blocks drafting
    ],
    ids=["ngram", "self-int4"],
)
def test_structured_requests_take_no_drafts_next_to_speculative_ones(quantization, speculative):
    llm = LLM(**ENGINE_KWARGS, quantization=quantization, speculative_config=speculative)
    repeating = " ".join(["Paged attention stores the key value cache in fixed size blocks."] * 4)
    params = [structured("json", PERSON, temperature=0, max_tokens=120), SamplingParams(temperature=0, max_tokens=48)]
    outputs = llm.generate([repeating, repeating], params, use_tqdm=False)
    check_person(outputs[0].outputs[0].text)
    assert llm.engine.stats().spec_accepted_tokens > 0  # the plain request still speculated
