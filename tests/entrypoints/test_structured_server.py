"""Structured outputs and forced tool calls through the official openai client against a real server on the
default model: whatever the 135M model would have said, the answer parses under the schema."""

from __future__ import annotations

import enum
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
import regex
from pydantic import BaseModel, Field

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe a person who owns pets."}]


class Role(enum.Enum):
    ENGINEER = "engineer"
    TEACHER = "teacher"


class Pet(BaseModel):
    kind: Literal["cat", "dog", "parrot"]
    name: str = Field(max_length=16)


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    role: Role
    pets: list[Pet] = Field(min_length=1, max_length=2)
    # Every string bounded: sampled at temperature 1.0 this 135M model can fill an unbounded string past any token
    # limit (a fifth to a third of the seeds ran 200 tokens), which is the model, not the grammar.
    nickname: str | None = Field(max_length=24)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}/[A-Z][a-z]{1,12}$"}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
# A set[str] field: pydantic writes uniqueItems, which the grammar engine cannot enforce.
TAGS = {
    "type": "function",
    "function": {
        "name": "tag",
        "parameters": {
            "type": "object",
            "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3,
                                    "uniqueItems": True}},
            "required": ["tags"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip


class Address(BaseModel):
    city: str = Field(max_length=16)
    country: Literal["FR", "IT", "JP"]


class Shipment(BaseModel):
    """Nested models: pydantic writes the Address under $defs and refers to it with $ref."""

    to: Address
    back: Address | None = None
    weight_kg: int = Field(ge=1, le=50)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3, "n": 2}])
def test_parse_with_a_pydantic_model(client, sampling):
    completion = client.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=Person, max_tokens=200, **sampling
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)
        assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_mode(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}, temperature=0, max_tokens=120
    )
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize(
    "body, check",
    [
        (
            {"structured_outputs": {"regex": r"[A-Z][a-z]{2,9}, [0-9]{4}"}},
            lambda t: regex.fullmatch(r"[A-Z][a-z]{2,9}, [0-9]{4}", t),
        ),
        ({"structured_outputs": {"choice": ["Paris", "Rome", "Berlin"]}}, lambda t: t in ("Paris", "Rome", "Berlin")),
        (
            {
                "structured_outputs": {
                    "grammar": 'start: item (", " item)? (", " item)?\nitem: "red" | "green" | "blue"'
                }
            },
            lambda t: regex.fullmatch(r"(red|green|blue)(, (red|green|blue)){0,2}", t),
        ),
        (
            {"guided_json": TOOLS["get_weather"]},
            lambda t: jsonschema.validate(json.loads(t), TOOLS["get_weather"]) is None,
        ),
        ({"guided_regex": "[0-9]+"}, lambda t: t.isdigit()),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ],
)
def test_vllm_structured_outputs_in_extra_body(client, body, check):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0.7, seed=1, max_tokens=60, extra_body=body
    )
    assert check(reply.choices[0].message.content), reply.choices[0].message.content


@pytest.mark.parametrize(
    "body, digits",
    [
        ({"guided_regex": r"\d{3}-\d{4}"}, lambda t: t),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "phone",
                        "schema": {
                            "type": "object",
                            "properties": {"number": {"type": "string", "pattern": r"^\d{3}-\d{4}$"}},
                            "required": ["number"],
                        },
                    },
                }
            },
            lambda t: json.loads(t)["number"],
        ),
    ],
)
def test_digit_classes_are_ascii(client, body, digits):
    """Asked for a phone number under \\d, the default model prefers U+1FBF8 ('🯸', a Unicode decimal digit) when
    \\d is Unicode; as vLLM's default backend reads it, \\d is [0-9]."""
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is your phone number?"}],
        temperature=0,
        max_tokens=40,
        extra_body={k: v for k, v in body.items() if k != "response_format"},
        **({"response_format": body["response_format"]} if "response_format" in body else {}),
    )
    assert regex.fullmatch("[0-9]{3}-[0-9]{4}", digits(reply.choices[0].message.content)), reply.choices[0]


def test_completions_take_structured_outputs_too(client):
    reply = client.completions.create(
        model=MODEL,
        prompt="The year the war ended:",
        max_tokens=8,
        temperature=0,
        extra_body={"guided_regex": "1[89][0-9]{2}"},
    )
    assert regex.fullmatch("1[89][0-9]{2}", reply.choices[0].text)


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            None,
            "invalid json",
        ),
        ({"structured_outputs": {"regex": "[a-"}}, None, "invalid regex"),
        ({"structured_outputs": {"grammar": "start: missing"}}, None, "invalid grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"json_schemas": {}}}, "structured_outputs", "json_schemas"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, None, "not several"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
            "schema",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER]}, "tool_choice", "--enable-auto-tool-choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "cannot also"),
        # Past the grammar engine's limits, or admitting nothing: refused before anything is queued.
        ({"structured_outputs": {"regex": "a{1000000}"}}, None, "cannot enforce"),
        ({"guided_regex": "((a{100}){100}){100}"}, None, "cannot enforce"),
        ({"guided_json": {"$ref": "#"}}, None, "cannot enforce"),
        (
            {
                "guided_json": {
                    "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}},
                    "$ref": "#/$defs/A",
                }
            },
            None,
            "cannot enforce",
        ),
        # strict: true asks for every keyword to be enforced; uniqueItems cannot be.
        (
            {"tools": [{**TAGS, "function": {**TAGS["function"], "strict": True}}], "tool_choice": "required"},
            None,
            "uniqueItems",
        ),
        (
            {
                "tools": [WEATHER, {**TAGS, "function": {**TAGS["function"], "strict": True}}],
                "tool_choice": "required",
            },
            "tools",
            "uniqueItems",
        ),
    ],
)
def test_bad_constraints_answer_400_naming_them(server, body, param, fragment):
    reply = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, **body}, timeout=60
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert fragment in error["message"]
    if param is not None:
        assert error["param"] == param
    assert server.metric("heteroserve:num_requests_running") == 0


def check_calls(calls, expected_names=None) -> None:
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[call.function.name])
    if expected_names is not None:
        assert [c.function.name for c in calls] == expected_names


def reassemble(chunks) -> tuple[str, list[dict], str]:
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
                if piece.id:
                    assert call["id"] is None, "the id comes once"
                    call["id"] = piece.id
                if piece.function and piece.function.name:
                    assert call["name"] is None, "the name comes once"
                    call["name"] = piece.function.name
                call["arguments"] += (piece.function.arguments or "") if piece.function else ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    "tool_choice, finish",
    [("required", "tool_calls"), ({"type": "function", "function": {"name": "get_time"}}, "stop")],
)
def test_forced_tool_calls_are_valid_and_stream_the_same(client, tool_choice, finish):
    messages = [{"role": "user", "content": "What time is it in Tokyo, and the weather there?"}]
    kwargs = dict(
        model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=0, max_tokens=150
    )
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == finish
    assert choice.message.content is None and choice.message.tool_calls
    check_calls(choice.message.tool_calls, ["get_time"] if isinstance(tool_choice, dict) else None)
    content, calls, streamed_finish = reassemble(client.chat.completions.create(**kwargs, stream=True))
    assert content == "" and streamed_finish == finish
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


def test_required_without_parallel_calls_makes_exactly_one(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo and Rome?"}],
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=4,
        n=3,
        max_tokens=150,
    )
    for choice in reply.choices:
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls)


def test_tool_choice_none_answers_in_prose(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=10
    )
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content


def test_nested_pydantic_tools_are_forced_with_their_defs(client):
    tool = openai.pydantic_function_tool(Shipment)
    assert "$defs" in tool["function"]["parameters"]
    for tool_choice in ("required", {"type": "function", "function": {"name": "Shipment"}}):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Ship 3 kg to Rome."}],
            tools=[tool, WEATHER],
            tool_choice=tool_choice,
            parallel_tool_calls=False,  # the 135M model repeats calls until max_tokens when it may
            temperature=0,
            max_tokens=120,
        )
        assert reply.choices[0].message.tool_calls, reply.choices[0]
        for call in reply.choices[0].message.tool_calls:
            schema = tool["function"]["parameters"] if call.function.name == "Shipment" else TOOLS["get_weather"]
            jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "tag"}}])
def test_keywords_a_lenient_tool_cannot_enforce_are_skipped(client, tool_choice):
    """A function without strict (or strict: false) is forced as response_format without strict is: uniqueItems
    is skipped, the rest of the schema still holds."""
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tag this post about cats."}],
        tools=[TAGS, {**TAGS, "function": {**TAGS["function"], "name": "tag2", "strict": False}}],
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=80,
    )
    (call, *_) = reply.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"tags"} and len(arguments["tags"]) <= 3


def test_a_function_without_parameters_takes_no_arguments(client):
    reply = client.chat.completions.create(
        model=MODEL,
        # Under "any object" the model writes {"20": {"20": ... here.
        messages=[{"role": "user", "content": "Roll two dice with 20 sides each."}],
        tools=[{"type": "function", "function": {"name": "roll_dice"}}],
        tool_choice={"type": "function", "function": {"name": "roll_dice"}},
        temperature=0,
        max_tokens=20,
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "roll_dice" and json.loads(call.function.arguments) == {}


def test_streamed_forced_calls_end_in_the_openai_clients_done_events(client):
    """The finish reason comes in a chunk of its own, after the calls, so the client's stream helper closes each
    call (`tool_calls.function.arguments.done`) as it does on OpenAI's streams."""
    with client.chat.completions.stream(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=0,
        max_tokens=150,
    ) as stream:
        done = [event for event in stream if event.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert calls and [(e.name, e.arguments) for e in done] == [(c.function.name, c.function.arguments) for c in calls]
    assert final.choices[0].finish_reason == "tool_calls"


# Validates, and the engine takes its first token; a few tokens on the lexer gives up ("too many expressions").
BREAKS_MID_ANSWER = "[a-z]{1,3}-(a{200000})"


def test_a_grammar_that_fails_while_generating_ends_the_request_with_an_error(server):
    """Never unconstrained text: a 400 naming the grammar's failure, or in a stream an error event then [DONE];
    the server goes on and nothing stays running."""
    body = {"messages": ASK, "max_tokens": 12, "temperature": 0, "guided_regex": BREAKS_MID_ANSWER}
    url = f"{server.base_url}/v1/chat/completions"
    before = server.metric("heteroserve:request_aborted_total", reason="grammar_error")
    reply = httpx.post(url, json=body, timeout=120)
    assert reply.status_code == 400, reply.text
    assert "grammar failed" in reply.json()["error"]["message"]
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as streamed:
        events = [line.removeprefix("data: ") for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "grammar failed" in json.loads(events[-2])["error"]["message"]
    text = "".join(
        choice["delta"].get("content") or "" for event in events[:-2] for choice in json.loads(event)["choices"]
    )
    assert regex.fullmatch(BREAKS_MID_ANSWER, text, partial=True), text
    after = server.metric("heteroserve:request_aborted_total", reason="grammar_error")
    assert after == before + 2
    assert server.metric("heteroserve:num_requests_running") == 0
    assert httpx.post(url, json={"messages": ASK, "max_tokens": 2}, timeout=60).status_code == 200
