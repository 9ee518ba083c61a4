"""--tool-call-parser glm45 through a real server and the openai client, with GLM-4.6's own chat template. The
default model does not write GLM tool calls on its own, so a regex steers its output into the format; what is
tested is the server's side: the template, the parser, streaming."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.server_process import ServerProcess
from tests.entrypoints.test_structured_server import WEATHER, reassemble

MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = Path(__file__).parent / "templates" / "glm-4.6.jinja"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GLM_CALL = (
    r"I will check\.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>[A-Z][a-z]{2,10}</arg_value>\n"
    r"<arg_key>unit</arg_key>\n<arg_value>(celsius|fahrenheit)</arg_value>\n</tool_call>"
)


@pytest.fixture(scope="module")
def glm_server():
    process = ServerProcess(
        "--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 * 1024**2), "--quantization", "none",
        "--enable-auto-tool-choice", "--tool-call-parser", "glm45", "--chat-template", str(TEMPLATE),
    )  # fmt: skip
    yield process
    process.stop()


def test_glm45_calls_are_parsed_and_stream_the_same(glm_server):
    client = openai.OpenAI(base_url=f"{glm_server.base_url}/v1", api_key="unused", max_retries=0)
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        temperature=0,
        max_tokens=80,
        extra_body={"structured_outputs": {"regex": GLM_CALL}},
    )
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will check."
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert list(arguments) == ["city", "unit"] and arguments["city"][0].isupper()
    content, calls, finish = reassemble(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls" and content.strip() == "I will check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", arguments)]


def test_glm45_reads_argument_types_from_the_request_tools(glm_server):
    """A string parameter whose value looks like a number stays a string: the server hands the parser the
    request's tool schemas."""
    client = openai.OpenAI(base_url=f"{glm_server.base_url}/v1", api_key="unused", max_retries=0)
    digits = GLM_CALL.replace("[A-Z][a-z]{2,10}", "[0-9]{4}")
    choice = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        temperature=0,
        max_tokens=80,
        extra_body={"structured_outputs": {"regex": digits}},
    ).choices[0]
    (call,) = choice.message.tool_calls
    city = json.loads(call.function.arguments)["city"]
    assert isinstance(city, str) and city.isdigit() and len(city) == 4


def test_glm45_history_reaches_the_template_in_its_format(glm_server):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 degrees"},
    ]
    base = glm_server.base_url
    tokens = httpx.post(f"{base}/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    prompt = httpx.post(f"{base}/detokenize", json={"tokens": tokens}, timeout=60).json()["prompt"]
    assert (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
        "<|observation|>\n<tool_response>\n18 degrees\n</tool_response><|assistant|>"
    ) in prompt
