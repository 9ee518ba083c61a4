"""Hostile and careless requests meet limits: request chat templates (refused by default, bounded in time and size
when trusted, in worker processes under a memory cap, rendered as transformers renders them), request bodies (413
past --max-request-body-bytes, large prompts tokenized off the event loop), --request-timeout over whole streams,
and the prompts of one completion request. Most run on a server of their own whose limits are small enough to
reach quickly."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from heteroserve import SamplingParams
from tests.entrypoints.server_process import ServerProcess
from tests.entrypoints.test_request_surface import _error
from tests.entrypoints.test_structured_server import WEATHER

HI = [{"role": "user", "content": "hi"}]
TOOLS_TEMPLATE = (Path(__file__).parent / "templates" / "chatml_tools.jinja").read_text()
# 2 * 10**8 empty iterations: minutes of rendering, with nothing to show for it.
NESTED_LOOPS = "{% for i in range(20000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"
TEMPLATE_TIMEOUT = 3.0
REQUEST_TIMEOUT = 6.0
BODY_LIMIT = 64 * 1024
MAX_PROMPTS = 4


@pytest.fixture(scope="module")
def limits_server():
    process = ServerProcess(
        "--max-model-len", "2048", "--kv-cache-memory-bytes", str(128 * 1024**2),
        "--trust-request-chat-template", "--chat-template-timeout", str(TEMPLATE_TIMEOUT),
        "--request-timeout", str(REQUEST_TIMEOUT), "--max-request-body-bytes", str(BODY_LIMIT),
        "--max-prompts-per-request", str(MAX_PROMPTS),
    )  # fmt: skip
    yield process
    process.stop()


def _slowest_health_while(server: ServerProcess, senders: list[threading.Thread]) -> float:
    """Starts the senders and polls /health (each answer must be 200) until they are done: its slowest answer."""
    for sender in senders:
        sender.start()
    slowest = 0.0
    while any(sender.is_alive() for sender in senders):
        before = time.monotonic()
        assert httpx.get(f"{server.base_url}/health", timeout=60).status_code == 200
        slowest = max(slowest, time.monotonic() - before)
        time.sleep(0.05)
    return slowest


def _post(server: ServerProcess, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=timeout)


def _idle(server: ServerProcess, timeout: float = 10) -> dict[str, float]:
    """Polls the engine gauges until nothing runs or holds a KV block; returns the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = {
            name: server.metric(f"heteroserve:{name}") for name in ("num_requests_running", "kv_cache_usage_perc")
        }
        if not any(gauges.values()) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.1)


def test_request_templates_are_refused_by_default(server):
    """A template is code the server runs: without --trust-request-chat-template it is a 400 saying how to allow
    it, in chat and in /tokenize alike, before anything is rendered."""
    for path in ("/v1/chat/completions", "/tokenize"):
        refused = _error(_post(server, path, {"messages": HI, "chat_template": NESTED_LOOPS}), 400, "chat_template")
        assert "--trust-request-chat-template" in refused["message"]


def test_templates_render_as_transformers_does(server, limits_server, default_tokenizer):
    """The model's template through /tokenize, and a trusted request template with tools (seen through the prompt
    token ids that prompt_logprobs returns), give transformers' apply_chat_template's tokens exactly."""
    history = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": '{"celsius": 21}', "tool_call_id": "call_1"},
        {"role": "user", "content": "And in Oslo? ünïcödé, 漢字"},
    ]
    plain = [m for m in history if m["role"] in ("system", "user")]
    expected = default_tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    tokens = _post(server, "/tokenize", {"messages": plain}).json()["tokens"]
    assert tokens == default_tokenizer.encode(expected, add_special_tokens=False)

    as_template = [
        {
            **m,
            "tool_calls": [
                {**c, "function": {**c["function"], "arguments": {"city": "Paris"}}} for c in m["tool_calls"]
            ],
        }
        if "tool_calls" in m
        else m
        for m in history
    ]  # transformers' templates take arguments as objects, which the server hands them
    expected = default_tokenizer.apply_chat_template(
        as_template, tools=[WEATHER], chat_template=TOOLS_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    ids = default_tokenizer.encode(expected, add_special_tokens=False)
    body = {
        "messages": history,
        "tools": [WEATHER],
        "tool_choice": "required",  # the tools reach the template ("auto" needs --enable-auto-tool-choice)
        "chat_template": TOOLS_TEMPLATE,
        "max_tokens": 1,
        "prompt_logprobs": 0,
    }
    reply = _post(limits_server, "/v1/chat/completions", body).json()
    assert reply["usage"]["prompt_tokens"] == len(ids)
    assert [int(next(iter(entry))) for entry in reply["prompt_logprobs"][1:]] == ids[1:]


def test_chat_template_kwargs_reach_the_template(limits_server, default_llm, default_tokenizer):
    template = "{{ greeting }}{% for m in messages %} {{ m.content }}{% endfor %}"
    kwargs = {"chat_template": template, "chat_template_kwargs": {"greeting": "Ahoy"}}
    expected = default_tokenizer.encode("Ahoy hi", add_special_tokens=False)
    assert _post(limits_server, "/tokenize", {"messages": HI, **kwargs}).json()["tokens"] == expected
    reply = _post(limits_server, "/v1/chat/completions", {"messages": HI, "max_tokens": 1, **kwargs}).json()
    assert reply["usage"]["prompt_tokens"] == len(expected)
    offline = default_llm.chat(
        HI,
        SamplingParams(max_tokens=1),
        use_tqdm=False,
        chat_template=template,
        chat_template_kwargs={"greeting": "Ahoy"},
    )
    assert offline[0].prompt_token_ids == expected
    clash = {"messages": HI, "max_tokens": 1, "chat_template_kwargs": {"add_generation_prompt": False}}
    _error(_post(limits_server, "/v1/chat/completions", clash), 400, "chat_template_kwargs")


def test_hostile_templates_stop_at_their_deadline_while_the_server_answers(limits_server):
    """Six renderings that would loop for minutes each answer 400 once --chat-template-timeout passes; a plain
    chat sent while they run is answered before any of them ends (six such renderings held every worker thread,
    and a plain chat waited a minute), and a template that multiplies a string to 10 MB is refused at once (it
    took 15 s, then a 400 for the prompt's length)."""
    hostile: list[tuple[httpx.Response, float]] = []

    def render_hostile() -> None:
        started = time.monotonic()
        response = _post(limits_server, "/v1/chat/completions", {"messages": HI, "chat_template": NESTED_LOOPS})
        hostile.append((response, time.monotonic() - started))

    threads = [threading.Thread(target=render_hostile) for _ in range(6)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # all six are rendering or waiting for a thread
    reply = _post(limits_server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2})
    assert reply.status_code == 200 and not hostile, "the plain chat waited for the hostile renderings"
    for thread in threads:
        thread.join()
    for response, elapsed in hostile:
        assert "--chat-template-timeout" in _error(response, 400, "chat_template")["message"]
        assert TEMPLATE_TIMEOUT <= elapsed < TEMPLATE_TIMEOUT + 10, elapsed

    started = time.monotonic()
    huge = _post(limits_server, "/v1/chat/completions", {"messages": HI, "chat_template": "{{ 'x' * 10000000 }}"})
    assert "characters" in _error(huge, 400, "chat_template")["message"]
    assert time.monotonic() - started < 5


# Steps that no check compiled into a template can interrupt, each with what its 400 names: a `%` format, center
# and indent build their whole width at once (in the server they ran 40 s, stalled /health and left it 1 GB
# larger; indent even answered 200), and urlize mapped over 400,000 items runs for seconds inside filters.
UNINTERRUPTIBLE_STEPS = {
    "{{ '%0999999999d' % 1 }}": "MiB of memory",
    "{{ 'x'|center(300000000) }}": "MiB of memory",
    "{{ 'x'|indent(300000000) }}": "MiB of memory",
    "{{ ('x' * 400000)|list|map('urlize')|map('urlize')|map('urlize')|map('urlize')|join|length }}": (
        "--chat-template-timeout"
    ),
}


def _rss_kib(server: ServerProcess) -> int:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


def test_uninterruptible_template_steps_stop_in_worker_processes(limits_server, default_tokenizer):
    """Request templates render in worker processes under a memory cap, killed at --chat-template-timeout: each of
    the steps above is a 400 naming its problem within the timeout, /health answers at once meanwhile, the server
    does not grow, and the replaced workers render the next template."""
    rss_before = _rss_kib(limits_server)
    answers: dict[str, tuple[httpx.Response, float]] = {}

    def send(template: str) -> None:
        started = time.monotonic()
        body = {"messages": HI, "chat_template": template, "max_tokens": 1}
        answers[template] = (_post(limits_server, "/v1/chat/completions", body), time.monotonic() - started)

    senders = [threading.Thread(target=send, args=(template,)) for template in UNINTERRUPTIBLE_STEPS]
    slowest_health = _slowest_health_while(limits_server, senders)
    for template, named in UNINTERRUPTIBLE_STEPS.items():
        response, elapsed = answers[template]
        assert named in _error(response, 400, "chat_template")["message"], template
        assert elapsed < TEMPLATE_TIMEOUT + 5, (template, elapsed)
    assert slowest_health < 1.0, slowest_health
    assert _rss_kib(limits_server) - rss_before < 100 * 1024
    plain = {"messages": HI, "chat_template": "{{ messages[0].content }}"}
    tokens = _post(limits_server, "/tokenize", plain).json()["tokens"]
    assert tokens == default_tokenizer.encode("hi", add_special_tokens=False)


def test_bodies_over_the_limit_answer_413(limits_server):
    """Refused from Content-Length before reading, and while counting a chunked body, which declares no length;
    a body under the limit is served."""
    url = f"{limits_server.base_url}/tokenize"
    body = json.dumps({"prompt": "word " * (BODY_LIMIT // 4)}).encode()
    declared = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert "--max-request-body-bytes" in _error(declared, 413)["message"]

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(body), 8192):
            yield body[start : start + 8192]

    chunked = httpx.post(url, content=chunks(), headers={"Content-Type": "application/json"}, timeout=60)
    assert "--max-request-body-bytes" in _error(chunked, 413)["message"]
    assert _post(limits_server, "/tokenize", {"prompt": "word " * (BODY_LIMIT // 8)}).status_code == 200


def test_health_answers_while_large_prompts_are_tokenized(server):
    """5 MB prompts tokenize for seconds in worker threads (they froze /health for 4.6 s on the event loop):
    /health keeps answering meanwhile, and the completion is refused for its length, naming the prompt."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 110_000
    results: dict[str, httpx.Response] = {}

    def send(path: str) -> None:
        results[path] = _post(server, path, {"prompt": prompt, "max_tokens": 1} if "v1" in path else {"prompt": prompt})

    senders = [threading.Thread(target=send, args=(path,)) for path in ("/tokenize", "/v1/completions")]
    started = time.monotonic()
    slowest_health = _slowest_health_while(server, senders)
    busy = time.monotonic() - started
    assert results["/tokenize"].json()["count"] > 1_000_000
    assert "maximum context length" in _error(results["/v1/completions"], 400, "prompt")["message"]
    # On the event loop /health waited for the whole tokenization; now it waits a part of it at worst (the threads
    # still take the GIL while they build the ids' lists, a quarter of the time on a slow 2-core machine).
    assert slowest_health < busy / 2, (slowest_health, busy)


def _events(server: ServerProcess, path: str, body: dict) -> list[str]:
    """The data lines of a streamed answer."""
    with httpx.stream("POST", f"{server.base_url}{path}", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def test_request_timeout_ends_streams_and_frees_their_blocks(limits_server):
    """Streams that would run for far longer than --request-timeout end at it with an error event in OpenAI's shape
    and [DONE] (a timeout used to apply to each token only), and their engine requests are aborted: nothing runs
    or holds KV blocks afterwards."""
    long = {"max_tokens": 2000, "ignore_eos": True}
    bodies = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "Tell me a story."}], **long},
        "/v1/completions": {"prompt": ["Once upon a time", "In a galaxy far away"], **long},
    }
    streams: dict[str, tuple[list[str], float]] = {}

    def read(path: str) -> None:
        started = time.monotonic()
        events = _events(limits_server, path, bodies[path])
        streams[path] = (events, time.monotonic() - started)

    readers = [threading.Thread(target=read, args=(path,)) for path in bodies]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    for path, (events, elapsed) in streams.items():
        assert events[-1] == "[DONE]", path
        error = json.loads(events[-2])["error"]
        assert error["code"] == 408 and error["type"] == "TimeoutError" and str(REQUEST_TIMEOUT) in error["message"]
        assert len(events) > 10, (path, len(events))  # it streamed until then
        assert REQUEST_TIMEOUT <= elapsed < REQUEST_TIMEOUT + 10, (path, elapsed)
    gauges = _idle(limits_server)
    assert not any(gauges.values()), gauges


def test_prompts_per_request_are_capped(limits_server):
    too_many = {"prompt": ["hi"] * (MAX_PROMPTS + 1), "max_tokens": 1}
    assert (
        "--max-prompts-per-request"
        in _error(_post(limits_server, "/v1/completions", too_many), 400, "prompt")["message"]
    )
    as_ids = {"prompt": [[1, 2]] * (MAX_PROMPTS + 1), "max_tokens": 1}
    _error(_post(limits_server, "/v1/completions", as_ids), 400, "prompt")
    reply = _post(limits_server, "/v1/completions", {"prompt": ["hi"] * MAX_PROMPTS, "max_tokens": 1}).json()
    assert len(reply["choices"]) == MAX_PROMPTS
