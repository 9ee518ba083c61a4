"""The glm4 tool-call parser (GLM-4-0414 / glm-4-9b-chat's `NAME\\n{arguments}` at the start of the answer):
arguments retyped by their parameters' schema, text that is not a call as content, streams that agree with
`extract` however the text is split, and the inverse of the checkpoint's own template
(tests/entrypoints/templates/glm-4-9b-0414.jinja)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heteroserve.entrypoints.openai.chat_template import TemplateJob, render_job
from heteroserve.entrypoints.openai.tool_parsers import tool_parser
from tests.entrypoints.test_tool_parsers import TRICKY, split, stream

TEMPLATE = Path(__file__).parent / "templates" / "glm-4-9b-0414.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "units": {"type": "array", "items": {"type": "string"}},
                "zip": {"type": ["string", "null"]},
            },
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


def calls_of(text: str, tools: list[dict] | None = None) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in tool_parser("glm4")(tools).extract(text).tool_calls]


def streamed(pieces: list[str], tools: list[dict] | None) -> tuple[str, list[tuple[str, object]]]:
    """The content and calls a stream of `pieces` gives, with the request's `tools`."""
    parser_stream = tool_parser("glm4")(tools).stream()
    deltas = [delta for piece in pieces for delta in parser_stream.feed(piece)] + parser_stream.finish()
    content = "".join(delta.get("content", "") for delta in deltas)
    return content, [(c.name, json.loads(c.arguments)) for c in parser_stream.tool_calls]


def assert_agrees(text: str, pieces: list[str], tools: list[dict] | None = None) -> None:
    extracted = tool_parser("glm4")(tools).extract(text)
    assert streamed(pieces, tools) == (extracted.content or "", calls_of(text, tools))


OUTPUT = (
    'get_weather\n{"city": "Zürich", "days": 2, "units": ["c"]}\n'
    '<|assistant|>get_weather \n{"city": "Paris {x}\\n\\"y\\"", "zip": null}'
    "\nnow\n{}"
)


def test_reads_several_calls_and_the_content_after_them():
    assert calls_of(OUTPUT, [WEATHER, NOW]) == [
        ("get_weather", {"city": "Zürich", "days": 2, "units": ["c"]}),
        ("get_weather", {"city": 'Paris {x}\n"y"', "zip": None}),
        ("now", {}),
    ]
    assert tool_parser("glm4")([WEATHER, NOW]).extract(OUTPUT).content is None
    text = OUTPUT + "\nDone, both cities."
    assert tool_parser("glm4")([WEATHER, NOW]).extract(text).content == "Done, both cities."
    assert_agrees(text, list(text), [WEATHER, NOW])


def test_arguments_are_retyped_as_their_parameters_schema_says():
    text = 'get_weather\n{"city": 2024, "days": "3", "units": "[\\"c\\"]", "zip": "8001", "other": "4"}'
    assert calls_of(text, [WEATHER]) == [
        ("get_weather", {"city": "2024", "days": 3, "units": ["c"], "zip": "8001", "other": "4"})
    ]
    assert calls_of(text) == [
        ("get_weather", {"city": 2024, "days": "3", "units": '["c"]', "zip": "8001", "other": "4"})
    ]
    assert_agrees(text, list(text), [WEATHER])


@pytest.mark.parametrize(
    "text",
    [
        "Zürich is cold.",
        "Sure\n{}",  # "Sure" is not one of the request's tools
        "get weather\n{}",
        "get_weather {}",
        'get_weather\n["city"]',
        'get_weather\n{"city": "Zürich"',
        "get_weather\n",
        "<|assistant|>",
        'Let me check.\nget_weather\n{"city": "Zürich"}',
    ],
)
def test_text_that_is_not_a_call_is_content(text):
    extracted = tool_parser("glm4")([WEATHER]).extract(text)
    assert (extracted.content, extracted.tool_calls) == (text.strip(), [])
    if not text.startswith('get_weather\n{"city": "Zürich"'):  # a cut-off call the stream has opened
        assert_agrees(text, list(text), [WEATHER])


def test_without_tools_any_name_line_starts_a_call():
    assert calls_of('lookup.v2-x\n  {"q": 1}') == [("lookup.v2-x", {"q": 1})]
    assert calls_of("Sure\n{}") == [("Sure", {})]


def test_reading_stops_at_the_first_text_that_is_not_a_call():
    text = 'now\n{}\nI will also check the weather.\nget_weather\n{"city": "Paris"}'
    extracted = tool_parser("glm4")([WEATHER, NOW]).extract(text)
    assert (extracted.content, calls_of(text, [WEATHER, NOW])) == (text[len("now\n{}\n") :], [("now", {})])
    assert_agrees(text, list(text), [WEATHER, NOW])


def test_stream_opens_at_the_brace_and_sends_each_argument_when_its_value_ends():
    parser_stream = tool_parser("glm4")([WEATHER]).stream()
    assert parser_stream.feed("get_wea") == []
    assert parser_stream.feed("ther\n") == []
    opened = parser_stream.feed('{"city": "Par')
    assert opened == [
        {"tool_calls": [{"index": 0, "id": opened[0]["tool_calls"][0]["id"], "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]}
    ]  # fmt: skip
    assert parser_stream.feed('is", "days": "3"') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris", "days": 3'}}]}
    ]
    assert parser_stream.feed("}\nThat is all.") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]},
        {"content": "That is all."},
    ]
    assert parser_stream.finish() == []
    assert [(c.name, c.arguments) for c in parser_stream.tool_calls] == [
        ("get_weather", '{"city": "Paris", "days": 3}')
    ]


def test_an_answer_that_opens_with_no_tools_name_streams_as_content_at_once():
    parser_stream = tool_parser("glm4")([WEATHER]).stream()
    assert parser_stream.feed("  Hel") == [{"content": "Hel"}]
    assert parser_stream.feed("lo\n{") == [{"content": "lo\n{"}]
    assert parser_stream.feed("get") == [{"content": "get"}]
    assert parser_stream.finish() == []


def test_a_call_cut_off_after_it_opened_stays_a_call_in_the_stream():
    text = 'get_weather\n{"city": "Paris", "days": 3, "uni'
    content, calls, _ = stream("glm4", list(text))
    assert (content, [(c.name, c.arguments) for c in calls]) == ("", [("get_weather", '{"city": "Paris", "days": 3}')])
    assert tool_parser("glm4")().extract(text).content == text


def test_the_parser_reads_back_what_the_glm4_0414_template_writes():
    """The template writes a call as `<|assistant|>NAME \\n` and the arguments' JSON (an assistant turn with
    `metadata`); the parser reads it back from the text after the template's `<|assistant|>`."""
    arguments = {"city": "Zürich", "days": 2, "units": ["c", "f"], "zip": None}
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "metadata": "get_weather", "content": json.dumps(arguments, ensure_ascii=False)},
        {"role": "observation", "content": '{"temp": 3}'},
    ]
    job = TemplateJob(TEMPLATE.read_text(), history, {}, tools=[WEATHER])
    prompt = render_job(job, timeout_s=5.0, max_chars=1 << 20)
    written = prompt[prompt.index("<|assistant|>get_weather") : prompt.index("<|observation|>")]
    assert calls_of(written, [WEATHER]) == [("get_weather", arguments)]
    assert tool_parser("glm4")([WEATHER]).extract(written).content is None


# --- streams agree with extract, however the text is split ------------------------------------------------------

names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,10}", fullmatch=True)
keys = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5) | st.sampled_from(TRICKY),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(keys, children, max_size=3),
    max_leaves=6,
)
separators = st.sampled_from(["", "\n", "\n\n", " ", "<|assistant|>", "\n<|assistant|>"])


@st.composite
def glm4_outputs(draw) -> tuple[str, list[tuple[str, dict]], list[dict]]:
    """Calls as GLM-4 writes them, content after them, and the tools they call (no schema types: no retyping)."""
    text, calls, tools = "", [], []
    for index in range(draw(st.integers(0, 3))):
        name = f"{draw(names)}{index}"
        arguments = draw(st.dictionaries(keys, json_values, max_size=3))
        tools.append({"type": "function", "function": {"name": name, "parameters": {"properties": {}}}})
        calls.append((name, arguments))
        space = draw(st.sampled_from(["", " "]))
        text += f"{draw(separators)}{name}{space}\n{json.dumps(arguments, ensure_ascii=draw(st.booleans()))}"
    tail = draw(st.lists(st.sampled_from([*TRICKY, "word", "\n", "{}"]), max_size=4).map("".join))
    text += draw(st.sampled_from(["\n", " "])) + "Done!" + tail if draw(st.booleans()) else ""
    return text, calls, tools


@settings(max_examples=150)
@given(data=st.data())
def test_streams_agree_with_extract_however_split(data):
    text, expected, tools = data.draw(glm4_outputs())
    assert calls_of(text, tools) == expected
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    assert_agrees(text, split(text, cuts), tools)


@settings(max_examples=150)
@given(data=st.data())
def test_streams_of_arbitrary_text_stay_well_formed(data):
    """Any text streams without error; when the stream opens no call, extract finds none and the contents agree."""
    pieces = [*TRICKY, "f", "get_weather", " ", "\n", "{", "}", '{"a": 1}', "<|assistant|>", "<|assis", '"', ":"]
    text = data.draw(st.lists(st.sampled_from(pieces), max_size=30).map("".join))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    content, calls, _ = stream("glm4", split(text, cuts))
    extracted = tool_parser("glm4")().extract(text)
    if not calls:
        assert (content, extracted.tool_calls) == (extracted.content or "", [])
