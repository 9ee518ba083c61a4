"""The rest of the request surface, on the session's server (and offline where the engine does the work):
fields heteroserve does not honour answer 400 naming them, unknown ones are logged, types are OpenAI's strict
ones, every 4xx has OpenAI's shape; logit_bias, allowed_token_ids and bad_words against transformers' own logits
processors; echo + logprobs and prompt_logprobs against transformers' log_softmax; chat template options."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
import torch

from heteroserve import SamplingParams
from tests.reference import ReferenceRun

MODEL = "SmolLM2-135M-Instruct"
HI = [{"role": "user", "content": "hi"}]
CAPITAL = "The capital of France is"
FRUIT = "My favourite fruit is the"
COMPLETION = {"prompt": "hi", "max_tokens": 1}
CHAT = {"messages": HI, "max_tokens": 1}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def _error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """OpenAI's error shape with this status; the param, when given, is named in it and in the message."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    if param is not None:
        assert error["param"] == param and param in error["message"], error
    return error


def _reference(hf, prompt_ids: list[int], max_new_tokens: int, **processors) -> ReferenceRun:
    """transformers' greedy run with its own logits processors (sequence_bias, bad_words_ids, ...)."""
    with torch.inference_mode():
        out = hf.model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **processors,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    return ReferenceRun(tokens, [step[0].float() for step in out.logits])


def _token_ids(choice) -> list[int]:
    return [int(t.split(":")[1]) for t in choice.logprobs.tokens]


UNHONOURED = [
    ("/v1/completions", {"suffix": " and so on"}, "suffix"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    ("/v1/completions", {"add_special_tokens": False}, "add_special_tokens"),
    ("/v1/completions", {"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ("/v1/completions", {"cache_salt": "pepper"}, "cache_salt"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "hello"}}, "prediction"),
    ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"store": True}, "store"),
    ("/v1/chat/completions", {"service_tier": "flex"}, "service_tier"),
    ("/v1/chat/completions", {"verbosity": "low"}, "verbosity"),
    ("/v1/chat/completions", {"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ("/v1/chat/completions", {"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {"include_reasoning": False}, "include_reasoning"),
    ("/v1/chat/completions", {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ("/v1/completions", {"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ("/v1/chat/completions", {"structural_tag": "{}"}, "structural_tag"),
    ("/v1/chat/completions", {"documents": [{"title": "t", "text": "x"}]}, "documents"),
    (
        "/v1/chat/completions",
        {"stream": True, "stream_options": {"include_obfuscation": True}},
        "stream_options.include_obfuscation",
    ),
    (
        "/v1/chat/completions",
        {"messages": [*HI, {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]},
        "messages[1].function_call",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi", "audio": {"id": "a"}}]},
        "messages[0].audio",
    ),
]


@pytest.mark.parametrize("path, fields, param", UNHONOURED)
def test_unhonoured_fields_are_400_naming_them(server, path, fields, param):
    base = COMPLETION if path == "/v1/completions" else CHAT
    assert "not supported" in _error(_post(server, path, {**base, **fields}), 400, param)["message"]


def test_unhonoured_fields_through_the_official_client(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, suffix=" the end")
    assert caught.value.body["param"] == "suffix"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, store=True)
    assert caught.value.body["param"] == "store"


def test_values_that_ask_for_nothing_are_accepted(client):
    """Defaults and bookkeeping labels: the answer is what it would be without them."""
    plain = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0)
    labelled = client.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=4,
        temperature=0,
        store=False,
        service_tier="auto",
        modalities=["text"],
        metadata={"team": "search"},
        user="u-1",
        safety_identifier="s-1",
        prompt_cache_key="k-1",
        extra_body={"use_beam_search": False, "length_penalty": 1, "spaces_between_special_tokens": True},
    )
    assert labelled.choices[0].message.content == plain.choices[0].message.content
    completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, best_of=1, suffix=None)
    assert completion.choices[0].finish_reason == "length"


def test_unknown_fields_are_ignored_and_logged(server):
    name = f"frobnicate_{uuid.uuid4().hex[:8]}"
    nested = f"colour_{uuid.uuid4().hex[:8]}"
    body = {**CHAT, name: 3, "messages": [{"role": "user", "content": "hi", nested: "blue"}]}
    assert _post(server, "/v1/chat/completions", body).status_code == 200
    log = server.log_text()
    assert f"ignoring request fields heteroserve does not know: {name}" in log
    assert f"messages[0].{nested}" in log


@pytest.mark.parametrize(
    "path, fields, param",
    [
        ("/v1/completions", {"max_tokens": "3"}, "max_tokens"),
        ("/v1/completions", {"stream": "yes"}, "stream"),
        ("/v1/completions", {"n": "2"}, "n"),
        ("/v1/completions", {"n": 2.0}, "n"),
        ("/v1/completions", {"seed": "7"}, "seed"),
        ("/v1/completions", {"echo": 1}, "echo"),
        ("/v1/completions", {"logprobs": "1"}, "logprobs"),
        ("/v1/completions", {"temperature": "0.5"}, "temperature"),
        ("/v1/completions", {"temperature": True}, "temperature"),
        ("/v1/completions", {"prompt": [1, "2"]}, "prompt"),
        ("/v1/chat/completions", {"logprobs": "true"}, "logprobs"),
        ("/v1/chat/completions", {"top_logprobs": "2", "logprobs": True}, "top_logprobs"),
        ("/v1/chat/completions", {"max_completion_tokens": "4"}, "max_completion_tokens"),
    ],
)
def test_types_are_not_coerced(server, path, fields, param):
    base = COMPLETION if path == "/v1/completions" else CHAT
    _error(_post(server, path, {**base, **fields}), 400, param)


def test_integers_are_numbers(server):
    assert _post(server, "/v1/completions", {**COMPLETION, "temperature": 0, "top_p": 1}).status_code == 200


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {**COMPLETION, "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"12": 101}}, "logit_bias"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"twelve": 1}}, "logit_bias"),
        ("/v1/completions", {**COMPLETION, "allowed_token_ids": []}, "allowed_token_ids"),
        ("/v1/completions", {**COMPLETION, "bad_words": [" "]}, "bad_words"),
    ],
)
def test_contradictions_and_bad_values_are_400(server, path, body, param):
    _error(_post(server, path, body), 400, param)


@pytest.mark.parametrize(
    "fields, named",
    [({"logit_bias": {"49152": 1}}, "logit_bias"), ({"allowed_token_ids": [5, 10**6]}, "allowed_token_ids")],
)
def test_token_ids_outside_the_vocabulary_are_400(server, fields, named):
    error = _error(_post(server, "/v1/completions", {**COMPLETION, **fields}), 400)
    assert named in error["message"] and "outside the vocabulary" in error["message"]


def test_routes_methods_and_bodies_answer_in_openai_shape(server, client):
    assert "/v1/nothing-here" in _error(httpx.get(f"{server.base_url}/v1/nothing-here"), 404)["message"]
    refused = httpx.delete(f"{server.base_url}/v1/chat/completions")
    assert "POST" in _error(refused, 405)["message"] and refused.headers["allow"] == "POST"
    not_utf8 = httpx.post(
        f"{server.base_url}/v1/completions",
        content=b'{"prompt": "caf\xe9"}',
        headers={"content-type": "application/json"},
    )
    assert "UTF-8" in _error(not_utf8, 400)["message"]
    assert _error(_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": 0}), 400, "n")
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    _error(httpx.get(f"{server.base_url}/v1/models/org/no-such-model"), 404, "model")


def test_logit_bias(client, default_llm, default_tokenizer, hf_default, greedy_comparison):
    ids = default_tokenizer.encode(CAPITAL)
    ask = dict(model=MODEL, prompt=ids, max_tokens=5, temperature=0, logprobs=0)
    as_ids = {"return_tokens_as_token_ids": True}
    greedy = _token_ids(client.completions.create(**ask, extra_body=as_ids).choices[0])
    banana = default_tokenizer.encode(" banana")[0]
    forced = client.completions.create(**ask, logit_bias={str(banana): 100}, extra_body=as_ids).choices[0]
    assert _token_ids(forced) == [banana] * 5
    # The raw model's logprobs, as vLLM reports them: the bias does not enter them.
    assert forced.logprobs.token_logprobs[0] < -5
    avoided = _token_ids(
        client.completions.create(**ask, logit_bias={str(greedy[0]): -100}, extra_body=as_ids).choices[0]
    )
    reference = _reference(hf_default, ids, 5, sequence_bias={(greedy[0],): -100.0})
    assert avoided[0] != greedy[0]
    greedy_comparison.check("logit_bias -100", avoided, reference)
    offline = default_llm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(temperature=0, max_tokens=5, logit_bias={greedy[0]: -100}),
        use_tqdm=False,
    )
    assert offline[0].outputs[0].token_ids == avoided


def test_allowed_token_ids(client, default_llm, default_tokenizer, hf_default, greedy_comparison):
    ids = default_tokenizer.encode(FRUIT)
    allowed = sorted(
        {t for word in (" apple", " pear", " plum", ".", " is", " a") for t in default_tokenizer.encode(word)}
    )
    reply = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=6,
        temperature=0,
        logprobs=0,
        extra_body={"allowed_token_ids": allowed, "return_tokens_as_token_ids": True, "ignore_eos": True},
    )
    tokens = _token_ids(reply.choices[0])
    assert set(tokens) <= set(allowed)
    reference = _reference(hf_default, ids, 6, prefix_allowed_tokens_fn=lambda batch, sofar: allowed)
    greedy_comparison.check("allowed_token_ids", tokens, reference)
    sampled = default_llm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=8, allowed_token_ids=allowed, ignore_eos=True),
        use_tqdm=False,
    )
    assert all(set(o.token_ids) <= set(allowed) for o in sampled[0].outputs)


def test_bad_words(client, default_llm, default_tokenizer, hf_default, greedy_comparison):
    """A word of two tokens the greedy answer contains: its second token is banned right after its first."""
    ids = default_tokenizer.encode(FRUIT)
    sequences = [default_tokenizer.encode(text, add_special_tokens=False) for text in ("Mango", " Mango")]
    assert any(len(s) == 2 for s in sequences) and all(s[0] != ids[-1] for s in sequences)
    ask = dict(model=MODEL, prompt=ids, max_tokens=8, temperature=0, logprobs=0)
    as_ids = {"return_tokens_as_token_ids": True}
    plain = client.completions.create(**ask, extra_body=as_ids).choices[0]
    assert "Mango" in plain.text
    banned = client.completions.create(**ask, extra_body={**as_ids, "bad_words": ["Mango"]}).choices[0]
    assert "Mango" not in banned.text
    reference = _reference(hf_default, ids, 8, bad_words_ids=sequences)
    greedy_comparison.check("bad_words", _token_ids(banned), reference)
    offline = default_llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8, bad_words=["Mango"]), use_tqdm=False
    )
    assert offline[0].outputs[0].token_ids == _token_ids(banned)


def test_offline_validation_before_queueing(default_llm):
    for params in (
        SamplingParams(logit_bias={10**6: 1.0}),
        SamplingParams(allowed_token_ids=[49152]),
    ):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            default_llm.generate("hi", params, use_tqdm=False)
        assert not default_llm.engine.has_unfinished_requests()


def _prompt_reference(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits: row i scores token i + 1."""
    return torch.log_softmax(hf.logits(ids), dim=-1)


def test_echo_with_logprobs_scores_the_prompt_as_transformers(client, default_tokenizer, hf_default):
    """lm-eval-harness' loglikelihood: echo=True, max_tokens 0 or 1, logprobs=k."""
    ids = default_tokenizer.encode(CAPITAL + " Paris")
    reference = _prompt_reference(hf_default, ids)
    for max_tokens in (0, 1):
        reply = client.completions.create(
            model=MODEL,
            prompt=CAPITAL + " Paris",
            max_tokens=max_tokens,
            echo=True,
            logprobs=2,
            temperature=0,
            extra_body={"return_tokens_as_token_ids": True},
        )
        choice = reply.choices[0]
        lp = choice.logprobs
        assert choice.text.startswith(CAPITAL + " Paris")
        assert _token_ids(choice)[: len(ids)] == ids and len(lp.tokens) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, len(ids)):
            assert lp.token_logprobs[i] == pytest.approx(float(reference[i - 1, ids[i]]), abs=1e-4)
            top = reference[i - 1].topk(2)
            expected = {f"token_id:{t}": float(v) for t, v in zip(top.indices.tolist(), top.values, strict=True)}
            expected[f"token_id:{ids[i]}"] = float(reference[i - 1, ids[i]])
            assert lp.top_logprobs[i] == pytest.approx(expected, abs=1e-4)
        assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == max_tokens
        if max_tokens == 0:
            assert choice.text == CAPITAL + " Paris" and choice.finish_reason == "length"
        else:
            generated = _token_ids(choice)[-1]
            assert lp.token_logprobs[-1] == pytest.approx(float(reference[-1, generated]), abs=1e-4)
    texts = client.completions.create(model=MODEL, prompt=CAPITAL, max_tokens=0, echo=True, logprobs=0)
    lp = texts.choices[0].logprobs
    assert "".join(lp.tokens) == CAPITAL
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_echo_streams_the_prompt_logprobs_first(client):
    ask = dict(model=MODEL, prompt=CAPITAL, max_tokens=3, echo=True, logprobs=1, temperature=0)
    full = client.completions.create(**ask).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**ask, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks for t in c.logprobs.tokens] == full.logprobs.tokens
    streamed = [v for c in chunks for v in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(full.logprobs.token_logprobs[1:], abs=1e-6)
    assert [o for c in chunks for o in c.logprobs.text_offset] == full.logprobs.text_offset
    only = [c.choices[0] for c in client.completions.create(**{**ask, "max_tokens": 0}, stream=True) if c.choices]
    assert [c.text for c in only] == [CAPITAL] and only[0].finish_reason == "length"


def test_prompt_logprobs(server, default_tokenizer, hf_default):
    ids = default_tokenizer.encode(CAPITAL)
    reference = _prompt_reference(hf_default, ids)
    body = {"prompt": CAPITAL, "max_tokens": 1, "prompt_logprobs": 2}
    entries = _post(server, "/v1/completions", body).json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for i, entry in enumerate(entries[1:], start=1):
        actual = entry[str(ids[i])]
        assert actual["logprob"] == pytest.approx(float(reference[i - 1, ids[i]]), abs=1e-4)
        assert actual["rank"] == int((reference[i - 1] > reference[i - 1, ids[i]]).sum()) + 1
        top = reference[i - 1].topk(2).indices.tolist()
        assert {str(t) for t in top} <= set(entry) and len(entry) <= 3
        assert entry[str(top[0])]["rank"] == 1 and entry[str(top[0])]["decoded_token"] == default_tokenizer.decode(
            top[:1]
        )
    chat = _post(server, "/v1/chat/completions", {**CHAT, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])


def test_continue_final_message(server, client, default_llm, default_tokenizer, hf_default, greedy_comparison):
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": CAPITAL},
    ]
    text = default_tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    assert text.endswith(CAPITAL)
    tokens = _post(server, "/tokenize", {"messages": messages, "continue_final_message": True}).json()["tokens"]
    assert tokens == ids
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert reply.usage.prompt_tokens == len(ids)
    continued = default_tokenizer.encode(reply.choices[0].message.content, add_special_tokens=False)
    greedy_comparison.check("continue_final_message", continued, hf_default.greedy(ids, len(continued)))
    offline = default_llm.chat(
        messages,
        SamplingParams(temperature=0, max_tokens=6),
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )[0]
    assert offline.prompt_token_ids == ids and offline.outputs[0].text == reply.choices[0].message.content
    both = {"messages": messages, "continue_final_message": True, "add_generation_prompt": True}
    _error(_post(server, "/v1/chat/completions", both), 400, "continue_final_message")
