"""The server through the official openai client and raw HTTP: a real process on 127.0.0.1."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from heteroserve import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_models_version_and_probes(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/health/ready").json() == {"status": "ready"}


def test_chat_matches_offline_engine(client, default_llm):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30)
    offline = default_llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    assert reply.choices[0].message.content == offline.outputs[0].text == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.usage.completion_tokens == len(offline.outputs[0].token_ids)
    assert reply.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=20)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_completion_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "The capital of France is Paris."
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens


def test_n_stop_seed_and_token_prompts(client, default_tokenizer):
    ids = default_tokenizer.encode("The weather today is")
    other = default_tokenizer.encode("Hello")
    many = client.completions.create(model=MODEL, prompt=[ids, other], n=2, temperature=1.0, seed=3, max_tokens=8)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    again = client.completions.create(model=MODEL, prompt=[ids, other], n=2, temperature=1.0, seed=3, max_tokens=8)
    assert [c.text for c in again.choices] == [c.text for c in many.choices]
    full = client.completions.create(model=MODEL, prompt="Count: one, two,", temperature=0, max_tokens=12).choices[0]
    stop = full.text.strip().split()[1]
    cut = client.completions.create(model=MODEL, prompt="Count: one, two,", temperature=0, max_tokens=12, stop=[stop])
    assert cut.choices[0].text == full.text[: full.text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs_match_offline(client, default_llm):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3)
    offline = default_llm.generate("The sky is", params, use_tqdm=False)[0].outputs[0]
    reply = client.completions.create(
        model=MODEL,
        prompt="The sky is",
        temperature=0,
        max_tokens=5,
        logprobs=3,
        extra_body={"return_tokens_as_token_ids": True},
    )
    lp = reply.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in offline.token_ids]
    for ours, entry, token in zip(lp.token_logprobs, offline.logprobs, offline.token_ids, strict=True):
        assert ours == pytest.approx(entry[token].logprob, abs=1e-4)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].token == "The" and content[0].logprob == content[0].top_logprobs[0].logprob


def test_concurrent_streams_equal_solo_runs(async_client, default_tokenizer, hf_default, greedy_comparison):
    """32 concurrent streaming clients; each output equals the greedy reference (near-ties as DEVELOPERS.md)."""
    prompts = [
        default_tokenizer.encode(f"Story {i}: the {['cat', 'dog', 'bird', 'fish'][i % 4]} went to") for i in range(32)
    ]
    max_tokens = [6 + (i * 5) % 14 for i in range(32)]

    async def one(ids, n):
        stream = await async_client.completions.create(
            model=MODEL,
            prompt=ids,
            temperature=0,
            max_tokens=n,
            stream=True,
            logprobs=0,
            extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
        )
        tokens = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs:
                tokens += [int(t.split(":")[1]) for t in chunk.choices[0].logprobs.tokens]
        return tokens

    async def run_all():
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens, strict=True)))

    results = asyncio.run(run_all())
    hf_default.model.generation_config.eos_token_id = None
    try:
        for i, (ids, n, tokens) in enumerate(zip(prompts, max_tokens, results, strict=True)):
            assert len(tokens) == n
            greedy_comparison.check(f"server-concurrent[{i}]", tokens, hf_default.greedy(ids, n))
    finally:
        hf_default.model.generation_config.eos_token_id = default_tokenizer.eos_token_id


def _post(server, path, body, **kwargs):
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60, **kwargs)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": []}, None),
    ],
)
def test_invalid_parameters_are_400(server, body, param):
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    if param:
        assert error["param"] == param and param in error["message"]


def test_other_errors(server, client):
    too_long = _post(server, "/v1/completions", {"prompt": [1] * 600, "max_tokens": 2})
    assert too_long.status_code == 400 and "maximum context length is 512" in too_long.json()["error"]["message"]
    malformed = httpx.post(
        f"{server.base_url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert malformed.status_code == 400 and "JSON" in malformed.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    # The server keeps serving after all of that.
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices[0].finish_reason


def test_tokenize_and_detokenize(server, default_tokenizer):
    tokens = _post(server, "/tokenize", {"prompt": "Hello world"}).json()["tokens"]
    assert tokens == default_tokenizer.encode("Hello world")
    assert _post(server, "/detokenize", {"tokens": tokens}).json()["prompt"] == "Hello world"
    chat = _post(server, "/tokenize", {"messages": QUESTION}).json()
    assert chat["count"] == len(chat["tokens"]) > 10
    assert _post(server, "/detokenize", {"tokens": [10**9]}).status_code == 400


def test_disconnect_aborts_and_frees_blocks(server):
    body = {"prompt": "Write a very long essay.", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i > 6:
                break
    for _ in range(100):
        if server.metric("heteroserve:num_requests_running") == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert server.metric("heteroserve:num_requests_running") == 0
    assert server.metric("heteroserve:kv_cache_usage_perc") == 0
    assert server.metric("heteroserve:request_success_total") >= 1


def test_non_streaming_disconnect_aborts_and_frees_blocks(server):
    """A client that gives up on a JSON answer (a read timeout here) has its request aborted, not finished."""
    generated = server.metric("heteroserve:generation_tokens_total")
    body = {"prompt": "Write a very long essay.", "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=1.0))
    for _ in range(50):
        if server.metric("heteroserve:num_requests_running") == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert server.metric("heteroserve:num_requests_running") == 0
    assert server.metric("heteroserve:kv_cache_usage_perc") == 0
    assert server.metric("heteroserve:generation_tokens_total") - generated < 480


def test_metrics_after_traffic(server):
    names = [
        "heteroserve:prompt_tokens_total",
        "heteroserve:generation_tokens_total",
        "heteroserve:time_to_first_token_seconds_count",
        "heteroserve:e2e_request_latency_seconds_count",
        "heteroserve:request_queue_time_seconds_count",
        "heteroserve:prefix_cache_queries_total",
    ]
    for name in names:
        assert server.metric(name) > 0, name
    text = httpx.get(f"{server.base_url}/metrics").text
    assert 'heteroserve:request_success_total{finished_reason="stop"' in text
