"""The glm45 tool-call parser (GLM-4.5 / GLM-4.6's `<tool_call>NAME <arg_key>/<arg_value>` pairs): arguments read by
their parameters' schema, text that is not a call as content, streams that agree with `extract` however the text
is split, and the inverse of the checkpoint's own template (tests/entrypoints/templates/glm-4.6.jinja)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heteroserve.entrypoints.openai.chat_template import TemplateJob, render_job
from heteroserve.entrypoints.openai.tool_parsers import tool_parser
from tests.entrypoints.test_tool_parsers import TRICKY, split, stream

TEMPLATE = Path(__file__).parent / "templates" / "glm-4.6.jinja"
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
                "unit": {"enum": ["c", "f"]},
                "zip": {"type": ["string", "null"]},
                "level": {"type": ["integer", "string"]},
            },
        },
    },
}


def call(name: str, *pairs: tuple[str, str], close: str = "\n</tool_call>") -> str:
    """A call written as GLM-4.6's template writes one."""
    return (
        f"<tool_call>{name}"
        + "".join(f"\n<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>" for k, v in pairs)
        + close
    )


def calls_of(text: str, tools: list[dict] | None = None) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in tool_parser("glm45")(tools).extract(text).tool_calls]


def streamed(text: str, pieces: list[str], tools: list[dict] | None) -> tuple[str, list[tuple[str, object]]]:
    """The content and calls a stream of `pieces` gives, with the request's `tools`."""
    parser_stream = tool_parser("glm45")(tools).stream()
    deltas = [delta for piece in pieces for delta in parser_stream.feed(piece)] + parser_stream.finish()
    content = "".join(delta.get("content", "") for delta in deltas)
    return content, [(c.name, json.loads(c.arguments)) for c in parser_stream.tool_calls]


def assert_agrees(text: str, pieces: list[str], tools: list[dict] | None = None) -> None:
    extracted = tool_parser("glm45")(tools).extract(text)
    assert streamed(text, pieces, tools) == (extracted.content or "", calls_of(text, tools))


OUTPUT = (
    "Let me check both.\n"
    + call("get_weather", ("city", "2024"), ("days", "2"), ("units", '["c", "f"]'), ("unit", "c"))
    + "\n"
    + call("get_weather", ("city", "Zürich </arg_key> <{x}>"), ("zip", "null"), ("level", "3"))
    + "\n"
    + call("now")
)


def test_arguments_are_read_as_their_parameters_schema_says():
    extracted = tool_parser("glm45")([WEATHER]).extract(OUTPUT)
    assert extracted.content == "Let me check both."
    assert calls_of(OUTPUT, [WEATHER]) == [
        ("get_weather", {"city": "2024", "days": 2, "units": ["c", "f"], "unit": "c"}),
        ("get_weather", {"city": "Zürich </arg_key> <{x}>", "zip": None, "level": 3}),
        ("now", {}),
    ]
    assert_agrees(OUTPUT, list(OUTPUT), [WEATHER])


def test_without_the_schema_values_that_are_json_are_read_as_json():
    assert calls_of(OUTPUT) == [
        ("get_weather", {"city": 2024, "days": 2, "units": ["c", "f"], "unit": "c"}),
        ("get_weather", {"city": "Zürich </arg_key> <{x}>", "zip": None, "level": 3}),
        ("now", {}),
    ]
    assert_agrees(OUTPUT, list(OUTPUT))


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("zip", "8001", "8001"),  # ["string", "null"] takes no number: the text stays a string
        ("zip", "null", None),
        ("level", "high", "high"),
        ("level", "4.5", "4.5"),  # an integer or a string: 4.5 is neither, so the text
        ("days", "two", "two"),  # not JSON: kept as written
        ("days", "NaN", "NaN"),  # not JSON either, whatever Python's json accepts
        ("other", ' [1, {"a": true}] ', [1, {"a": True}]),  # a parameter the schema does not name: JSON if it is
        ("city", "  spaced\n", "  spaced\n"),  # strings exactly as written
    ],
)
def test_values_by_schema_type(key, value, expected):
    assert calls_of(call("get_weather", (key, value)), [WEATHER]) == [("get_weather", {key: expected})]


@pytest.mark.parametrize(
    "text",
    [
        "Use <tool_call> wisely.",
        "<tool_call>\nf\n</tool_call>",
        "<tool_call>f(x)</tool_call>",
        "<tool_call>f\n<arg_key>a</arg_key>\nb</tool_call>",
        "<tool_call>f\n<arg_key>a</arg_key>x</arg_key><arg_value>1</arg_value></tool_call>",
        "<tool_call>f\nhello</tool_call>",
        "<tool_call>f",
        "<tool_call>f\n",
        "a <tool_ca",
    ],
)
def test_text_that_is_not_calls_is_content(text):
    extracted = tool_parser("glm45")().extract(text)
    assert (extracted.content, extracted.tool_calls) == (text.strip(), [])
    assert_agrees(text, list(text))


def test_reading_goes_on_after_a_marker_that_is_not_a_call():
    text = "<tool_call>oops <tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call> done"
    extracted = tool_parser("glm45")().extract(text)
    assert (extracted.content, calls_of(text)) == ("<tool_call>oops  done", [("f", {"a": 1})])
    assert_agrees(text, list(text))


def test_an_unterminated_last_block_is_a_call_once_it_holds_a_whole_pair():
    text = "Sure." + call("f", ("a", "1"), close="\n")
    assert calls_of(text) == [("f", {"a": 1})]
    assert tool_parser("glm45")().extract(text).content == "Sure."
    assert_agrees(text, list(text))


def test_stream_opens_at_the_first_value_and_sends_each_argument_when_its_value_ends():
    parser_stream = tool_parser("glm45")([WEATHER]).stream()
    assert parser_stream.feed("Hi <tool_call>get_weather\n<arg_") == [{"content": "Hi"}]
    assert parser_stream.feed("key>city</arg_key>\n<arg_val") == []
    opened = parser_stream.feed("ue>Par")
    assert opened[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert len(opened) == 1
    assert parser_stream.feed("is</arg_value>") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"'}}]}
    ]
    assert parser_stream.feed("\n<arg_key>days</arg_key><arg_value>3</arg_value>\n</tool") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ', "days": 3'}}]}
    ]
    assert parser_stream.feed("_call> bye") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]},
        {"content": "  bye"},  # the space held after "Hi", and the one before "bye"
    ]
    assert parser_stream.finish() == []
    assert [(c.name, c.arguments) for c in parser_stream.tool_calls] == [
        ("get_weather", '{"city": "Paris", "days": 3}')
    ]


def test_a_call_that_breaks_after_it_opened_stays_a_call_in_the_stream():
    text = "<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value>\noops</tool_call>"
    content, calls, _ = stream("glm45", list(text))
    assert (content, [(c.name, c.arguments) for c in calls]) == ("oops</tool_call>", [("f", '{"a": 1}')])
    assert tool_parser("glm45")().extract(text).content == text


def test_the_parser_reads_back_what_the_glm46_template_writes():
    arguments = {"city": "2024", "days": 2, "units": ["c"], "unit": "f", "zip": None, "level": "high"}
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": arguments}}],
        },
    ]
    job = TemplateJob(TEMPLATE.read_text(), history, {}, tools=[WEATHER])
    prompt = render_job(job, timeout_s=5.0, max_chars=1 << 20)
    written = prompt[prompt.rindex("<tool_call>get_weather") :]
    assert written.endswith("</tool_call>")
    assert calls_of(written, [WEATHER]) == [("get_weather", arguments)]


# --- streams agree with extract, however the text is split ------------------------------------------------------

MARKERS = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<tool_c", "</arg"]
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,10}", fullmatch=True)
keys = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
texts = st.lists(st.sampled_from(TRICKY + MARKERS), max_size=8).map("".join).filter(lambda t: "</arg_value>" not in t)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(keys, children, max_size=3),
    max_leaves=6,
)


@st.composite
def glm_outputs(draw) -> tuple[str, list[tuple[str, dict]], list[dict]]:
    """Content and calls as the template writes them, and the tools whose schemas read them back."""
    content = texts.filter(lambda t: "<tool_call>" not in t)
    text, calls, tools = draw(content), [], []
    for index in range(draw(st.integers(0, 3))):
        name, properties, arguments, pairs = f"{draw(names)}{index}", {}, {}, []
        for key in draw(st.lists(keys, max_size=3, unique=True)):
            if draw(st.booleans()):
                value = draw(texts)
                properties[key], written = {"type": "string"}, value
            else:
                value = draw(json_values)
                written = json.dumps(value, ensure_ascii=False)
            arguments[key] = value
            pairs.append((key, written))
        tools.append({"type": "function", "function": {"name": name, "parameters": {"properties": properties}}})
        calls.append((name, arguments))
        text += call(name, *pairs, close=draw(st.sampled_from(["\n</tool_call>", "</tool_call>"]))) + draw(content)
    return text, calls, tools


@settings(max_examples=150)
@given(data=st.data())
def test_streams_agree_with_extract_however_split(data):
    text, expected, tools = data.draw(glm_outputs())
    assert calls_of(text, tools) == expected
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    assert_agrees(text, split(text, cuts), tools)


@settings(max_examples=150)
@given(data=st.data())
def test_streams_of_arbitrary_text_stay_well_formed(data):
    """Any text streams without error; when the stream opens no call, extract finds none and the contents agree."""
    pieces = TRICKY + MARKERS * 2 + ["f", "get_weather", "\n", "<tool_call>f\n", "<arg_key>a</arg_key>", "1"] * 2
    text = data.draw(st.lists(st.sampled_from(pieces), max_size=30).map("".join))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    content, calls, _ = stream("glm45", split(text, cuts))
    extracted = tool_parser("glm45")().extract(text)
    if not calls:
        assert (content, extracted.tool_calls) == (extracted.content or "", [])
