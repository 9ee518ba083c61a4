"""Tool calling with tool_choice "auto", reasoning content and tool-call history, through a real server started
as vLLM users start one: --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3 and a
tool-aware --chat-template. The default model does not write tool calls on its own, so these requests steer its
output with a regex into the Hermes format; what is tested is the server's side: the template, the parser,
streaming, and where the grammar starts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.server_process import ServerProcess
from tests.entrypoints.test_structured_server import TOOLS, WEATHER, reassemble

MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = Path(__file__).parent / "templates" / "chatml_tools.jinja"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Some prose, then one Hermes tool call whose city the model chooses.
HERMES_CALL = (
    r'I will look it up\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "[A-Z][a-z]{2,10}", "unit": "(celsius|fahrenheit)"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def tools_server():
    process = ServerProcess(
        "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 * 1024**2), "--quantization", "none",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
        "--chat-template", str(TEMPLATE),
    )  # fmt: skip
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(tools_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tools_server.base_url}/v1", api_key="unused", max_retries=0)


def test_auto_tool_calls_are_parsed_and_stream_the_same(client):
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        temperature=0,
        max_tokens=80,
        extra_body={"structured_outputs": {"regex": HERMES_CALL}, "chat_template_kwargs": {"enable_thinking": False}},
    )
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look it up."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["city"][0].isupper()
    content, calls, finish = reassemble(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls" and content.strip() == choice.message.content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", arguments)]
    assert all(c["id"] for c in calls)
    assert TOOLS["get_weather"]["required"] == sorted(arguments)


def test_auto_keeps_one_call_without_parallel_tool_calls(client):
    """The model writes two calls; with parallel_tool_calls false only the first is returned, whole or streamed."""
    two_calls = HERMES_CALL + r"\n" + HERMES_CALL.removeprefix(r"I will look it up\.\n")
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        temperature=0,
        max_tokens=120,
        extra_body={"structured_outputs": {"regex": two_calls}, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert len(client.chat.completions.create(**kwargs).choices[0].message.tool_calls) == 2
    single = client.chat.completions.create(**kwargs, parallel_tool_calls=False).choices[0]
    assert len(single.message.tool_calls) == 1 and single.finish_reason == "tool_calls"
    _, calls, finish = reassemble(client.chat.completions.create(**kwargs, parallel_tool_calls=False, stream=True))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (single.message.tool_calls[0].function.name, single.message.tool_calls[0].function.arguments)
    ]


def test_auto_without_a_call_is_plain_content(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=12,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")  # not "tool_calls"


def test_reasoning_goes_to_reasoning_content(client):
    """The Qwen3 format: <think>...</think> then the answer (here steered, on a prompt that closes no reasoning
    block of its own, so the grammar applies from the first token)."""
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=60,
        extra_body={
            "structured_outputs": {"regex": r"<think>\n[a-z ,]{5,40}\n</think>\n\n[A-Z][a-z ]{2,30}\."},
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    message = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert message.content and message.content[0].isupper() and message.content.endswith(".")
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed_reasoning = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices
    )
    streamed_content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (streamed_reasoning, streamed_content) == (reasoning, message.content)


def test_constraints_hold_when_the_output_does_not_open_with_think(client):
    """Thinking left on (the prompt leaves the model to open a reasoning block): the 135M model writes no
    `<think>`, so under Qwen3's format its whole output is the answer, constrained from its first token, and the
    schema, a forced call and a regex all hold."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name a city."}], temperature=0, max_tokens=80)
    answer = client.chat.completions.create(
        **kwargs,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": TOOLS["get_weather"]}},
    ).choices[0]
    assert json.loads(answer.message.content)["unit"] in ("celsius", "fahrenheit")
    assert answer.message.model_extra["reasoning_content"] is None
    forced = client.chat.completions.create(**kwargs, tools=[WEATHER], tool_choice="required").choices[0]
    assert forced.finish_reason == "tool_calls" and forced.message.tool_calls[0].function.name == "get_weather"
    steered = client.chat.completions.create(**kwargs, extra_body={"guided_regex": "[A-Z][a-z]{2,12}"}).choices[0]
    assert re.fullmatch("[A-Z][a-z]{2,12}", steered.message.content), steered.message.content


def test_history_with_tool_calls_reaches_the_template(tools_server):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    tokens = httpx.post(f"{tools_server.base_url}/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    prompt = httpx.post(f"{tools_server.base_url}/detokenize", json={"tokens": tokens}, timeout=60).json()["prompt"]
    # The arguments reach the template as an object, written once as JSON (not a JSON string encoded again).
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in prompt
    reply = httpx.post(
        f"{tools_server.base_url}/v1/chat/completions",
        json={"messages": messages, "tools": [WEATHER], "max_tokens": 8, "temperature": 0},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    bad = [
        *messages[:1],
        {
            **messages[1],
            "tool_calls": [{**messages[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": "{oops"}}],
        },
    ]
    # Arguments that are not JSON reach the template as the string they are, as OpenAI passes them on.
    tokens = httpx.post(f"{tools_server.base_url}/tokenize", json={"messages": bad}, timeout=60).json()["tokens"]
    prompt = httpx.post(f"{tools_server.base_url}/detokenize", json={"tokens": tokens}, timeout=60).json()["prompt"]
    assert '"arguments": "{oops"' in prompt
    reply = httpx.post(f"{tools_server.base_url}/v1/chat/completions", json={"messages": bad, "max_tokens": 4})
    assert reply.status_code == 200, reply.text
