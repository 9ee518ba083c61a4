"""Tool-call parsers: realistic outputs per format, and streams that agree with `extract` however text is split.

The agreement, for outputs whose calls are well-formed: the streamed content joins to exactly `extract`'s content
(both strip the whitespace at the two ends of the text outside the calls; "" stands for None), the streamed calls
come in order with extract's names, and each call's argument fragments join to JSON equal to extract's arguments.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from heteroserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolCall, tool_parser

ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")


def stream(name: str, pieces: list[str]) -> tuple[str, list[ToolCall], list[dict]]:
    """Streams `pieces` through the parser; returns the content, the calls rebuilt from the deltas, the deltas.

    Checks the deltas' shape on the way: a call's first delta carries index, id, type and name (arguments ""),
    later ones only its index and an arguments fragment, and calls open in index order.
    """
    parser_stream = tool_parser(name)().stream()
    deltas = [delta for piece in pieces for delta in parser_stream.feed(piece)] + parser_stream.finish()
    content, calls = "", []
    for delta in deltas:
        if "content" in delta:
            assert list(delta) == ["content"] and delta["content"]
            content += delta["content"]
            continue
        assert list(delta) == ["tool_calls"]
        (piece,) = delta["tool_calls"]
        if "id" in piece:
            assert piece["index"] == len(calls) and piece["type"] == "function"
            assert ID.fullmatch(piece["id"]) and piece["function"]["arguments"] == ""
            calls.append(ToolCall(piece["id"], piece["function"]["name"], ""))
        else:
            assert set(piece) == {"index", "function"} and list(piece["function"]) == ["arguments"]
            assert piece["index"] == len(calls) - 1 and piece["function"]["arguments"]
            calls[-1].arguments += piece["function"]["arguments"]
    assert parser_stream.tool_calls == calls
    assert len({call.id for call in calls}) == len(calls)
    return content, calls, deltas


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[start:end] for start, end in zip(bounds, bounds[1:], strict=False)]


def assert_agrees(name: str, text: str, pieces: list[str]) -> None:
    extracted = tool_parser(name)().extract(text)
    content, calls, _ = stream(name, pieces)
    assert content == (extracted.content or "")
    assert [call.name for call in calls] == [call.name for call in extracted.tool_calls]
    for streamed, whole in zip(calls, extracted.tool_calls, strict=True):
        assert json.loads(streamed.arguments) == json.loads(whole.arguments)


def calls_of(text: str, name: str) -> list[tuple[str, object]]:
    return [(call.name, json.loads(call.arguments)) for call in tool_parser(name)().extract(text).tool_calls]


# --- realistic outputs ---------------------------------------------------------------------------------------------

QWEN_OUTPUT = (
    "I'll look both up.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "note": "use {braces} and \\"quotes\\""}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"name": "search", "arguments": {"q": "}{", "filters": {"tags": ["a", {"b": [1, 2]}], "x": null}}}\n'
    "</tool_call>"
)


def test_hermes_reads_content_and_several_calls_with_nested_arguments():
    extracted = tool_parser("hermes")().extract(QWEN_OUTPUT)
    assert extracted.content == "I'll look both up."
    assert calls_of(QWEN_OUTPUT, "hermes") == [
        ("get_weather", {"city": "Zürich", "note": 'use {braces} and "quotes"'}),
        ("search", {"q": "}{", "filters": {"tags": ["a", {"b": [1, 2]}], "x": None}}),
    ]
    assert extracted.tool_calls[0].to_openai() == {
        "id": extracted.tool_calls[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": extracted.tool_calls[0].arguments},
    }
    assert ID.fullmatch(extracted.tool_calls[0].id)
    assert_agrees("hermes", QWEN_OUTPUT, list(QWEN_OUTPUT))


def test_hermes_unterminated_block_is_a_call_only_when_its_json_is_complete():
    complete = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
    assert calls_of(complete, "hermes") == [("f", {"a": 1})]
    cut = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": '
    assert tool_parser("hermes")().extract(cut).content == cut.strip()
    assert tool_parser("hermes")().extract(cut).tool_calls == []


def test_hermes_invalid_blocks_and_stray_markers_are_content():
    text = "a <tool_call>not json</tool_call> b </tool_call> <tool_c"
    extracted = tool_parser("hermes")().extract(text)
    assert (extracted.content, extracted.tool_calls) == (text, [])
    for invalid in ('{"name": 3, "arguments": {}}', '{"name": "f", "arguments": "{}"}', '{"arguments": {}}', "[1]"):
        text = f"<tool_call>{invalid}</tool_call>"
        assert tool_parser("hermes")().extract(text).content == text
        assert_agrees("hermes", text, list(text))


def test_hermes_call_without_arguments_takes_none():
    text = '<tool_call>\n{"name": "now"}\n</tool_call>'
    assert calls_of(text, "hermes") == [("now", {})]
    assert_agrees("hermes", text, list(text))


def test_stream_holds_back_only_a_possible_marker():
    parser_stream = tool_parser("hermes")().stream()
    assert parser_stream.feed("Hello <tool_c") == [{"content": "Hello"}]
    assert parser_stream.feed("x") == [{"content": " <tool_cx"}]
    assert parser_stream.feed(" <tool") == []
    assert parser_stream.finish() == [{"content": " <tool"}]


def test_stream_forwards_arguments_before_the_call_ends():
    parser_stream = tool_parser("hermes")().stream()
    assert parser_stream.feed('<tool_call>\n{"name": "get_weather", ') == []
    opened = parser_stream.feed('"arguments": {"city": "Par')
    assert opened[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert opened[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Par'}}]}
    assert parser_stream.feed('is"}') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'is"}'}}]}]
    assert parser_stream.feed("}\n</tool_call>") == []
    assert parser_stream.finish() == []
    assert [(call.name, call.arguments) for call in parser_stream.tool_calls] == [("get_weather", '{"city": "Paris"}')]


def test_stream_sends_arguments_that_came_before_the_name_once_it_arrives():
    text = '<tool_call>{"arguments": {"x": [1, "}"]}, "name": "f"}</tool_call>'
    content, calls, _ = stream("hermes", list(text))
    assert (content, [(call.name, json.loads(call.arguments)) for call in calls]) == ("", [("f", {"x": [1, "}"]})])


def test_stream_sends_a_block_that_cannot_be_a_call_as_content_at_once():
    parser_stream = tool_parser("hermes")().stream()
    assert parser_stream.feed("<tool_call>\n{not json") == [{"content": "<tool_call>\n{not json"}]
    assert parser_stream.feed("}</tool_call> ok") == [{"content": "}</tool_call> ok"}]


@pytest.mark.parametrize(
    ("name", "text", "streamed"),
    [
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": [1, ', ("", '{"a": [1, ')),
        ("llama3_json", '{"name": "f", "parameters": {"a": ', ("", '{"a": ')),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}', ("", '{"a": 1}')),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": 1}]', (', {"name": 1}]', "{}")),
    ],
)
def test_a_call_that_breaks_after_it_opened_stays_a_call_in_the_stream(name, text, streamed):
    """The stream cannot take back a call it sent, while extract, seeing the whole text, calls it content."""
    content, calls, _ = stream(name, list(text))
    assert (content, [(call.name, call.arguments) for call in calls]) == (streamed[0], [("f", streamed[1])])
    assert tool_parser(name)().extract(text).content == text.strip()


LLAMA_OUTPUT = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "東京", "unit": "c"}}; '
    '{"name": "search", "arguments": {"q": "a; {b}", "n": 3}}'
)


def test_llama3_reads_python_tag_and_calls_joined_by_semicolons():
    assert tool_parser("llama3_json")().extract(LLAMA_OUTPUT).content is None
    assert calls_of(LLAMA_OUTPUT, "llama3_json") == [
        ("get_weather", {"city": "東京", "unit": "c"}),
        ("search", {"q": "a; {b}", "n": 3}),
    ]
    assert_agrees("llama3_json", LLAMA_OUTPUT, list(LLAMA_OUTPUT))
    plain = '\n{"name": "f", "parameters": {}};\n'
    assert calls_of(plain, "llama3_json") == [("f", {})]
    assert tool_parser("llama3_json")().extract(plain).content is None


@pytest.mark.parametrize(
    "text",
    [
        "The weather is {sunny}.",
        '{"answer": 42}',
        '{"name": "Bob", "age": 3}',
        '<|python_tag|>print("hi")',
        '{"name": "f"}',
        '{"name": "f", "parameters": [1]}',
        "<|python_",
        "  ",
    ],
)
def test_llama3_output_that_is_not_calls_is_content(text):
    extracted = tool_parser("llama3_json")().extract(text)
    assert (extracted.content, extracted.tool_calls) == (text.strip() or None, [])
    assert_agrees("llama3_json", text, list(text))


def test_llama3_text_after_the_calls_is_content():
    text = '{"name": "f", "parameters": {}}; and then {"oops"'
    extracted = tool_parser("llama3_json")().extract(text)
    assert (extracted.content, calls_of(text, "llama3_json")) == ('; and then {"oops"', [("f", {})])
    assert_agrees("llama3_json", text, list(text))


MISTRAL_ARRAY = (
    'Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "q": "[x] \\"y\\""}}, '
    '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]'
)
MISTRAL_NAMED = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "opts": {"a": [1]}}[TOOL_CALLS]get_time[ARGS]{}'


def test_mistral_reads_the_array_form_and_the_name_args_form():
    assert tool_parser("mistral")().extract(MISTRAL_ARRAY).content == "Checking."
    assert calls_of(MISTRAL_ARRAY, "mistral") == [
        ("get_weather", {"city": "Paris", "q": '[x] "y"'}),
        ("get_time", {"tz": "Europe/Paris"}),
    ]
    assert calls_of(MISTRAL_NAMED, "mistral") == [
        ("get_weather", {"city": "Paris", "opts": {"a": [1]}}),
        ("get_time", {}),
    ]
    assert tool_parser("mistral")().extract(MISTRAL_NAMED).content is None
    for text in (MISTRAL_ARRAY, MISTRAL_NAMED):
        assert_agrees("mistral", text, list(text))


@pytest.mark.parametrize(
    "text",
    [
        "Use [TOOL_CALLS] wisely.",
        '[TOOL_CALLS][{"name": 1}, {"name": "f", "arguments": {}}]',
        "[TOOL_CALLS]f[ARG]{}",
        '[TOOL_CALLS]f[ARGS]"x"',
        "[TOOL_CALLS][1]",
        '[TOOL_CALLS][{"name": "f", "arg',
        "a [TOOL_CA",
    ],
)
def test_mistral_text_that_is_not_calls_is_content(text):
    extracted = tool_parser("mistral")().extract(text)
    assert (extracted.content, extracted.tool_calls) == (text.strip(), [])
    assert_agrees("mistral", text, list(text))


def test_mistral_reads_on_after_a_marker_that_is_not_calls():
    text = '[TOOL_CALLS] oops [TOOL_CALLS]f[ARGS]{"a": 1} done'
    extracted = tool_parser("mistral")().extract(text)
    assert (extracted.content, calls_of(text, "mistral")) == ("[TOOL_CALLS] oops  done", [("f", {"a": 1})])
    assert_agrees("mistral", text, list(text))


def test_tool_parser_names_the_known_parsers():
    assert set(TOOL_PARSERS) == {"glm4", "glm45", "hermes", "llama3_json", "mistral"}
    with pytest.raises(ValueError, match="glm45, hermes, llama3_json, mistral"):
        tool_parser("nope")


# --- streams agree with extract, however the text is split ------------------------------------------------------

TRICKY = ["a", "Z", " ", "\n", "\t", "{", "}", "[", "]", '"', "\\", ":", ",", ";", "<", ">", "/", "é", "中", "😀"]
MARKERS = ["<tool_call>", "</tool_call>", "<tool_c", "[TOOL_CALLS]", "[TOOL_C", "[ARGS]", "<|python_tag|>", "<|py"]
strings = st.lists(st.sampled_from(TRICKY + MARKERS), max_size=8).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | strings,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(strings, children, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(strings, json_values, max_size=4)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)


@st.composite
def dumps(draw, value: object) -> str:
    """`value` as JSON the way some model might space it."""
    indent = draw(st.sampled_from([None, 1]))
    separators = draw(st.sampled_from([None, (",", ":"), (", ", ": ")]))
    return json.dumps(value, ensure_ascii=draw(st.booleans()), indent=indent, separators=separators)


@st.composite
def call_objects(draw, argument_keys: list[str]) -> tuple[str, tuple[str, dict]]:
    name, args, key = draw(names), draw(arguments), draw(st.sampled_from(argument_keys))
    members = [("name", name), (key, args)]
    if draw(st.booleans()):
        members.reverse()
    return draw(dumps(dict(members))), (name, args)


def content_text(markers: list[str]) -> st.SearchStrategy[str]:
    return st.lists(st.sampled_from(TRICKY + markers), max_size=10).map("".join)


@st.composite
def hermes_outputs(draw) -> tuple[str, list[tuple[str, dict]]]:
    content = content_text(["</tool_call>", "<tool_c", "<tool_call"]).filter(lambda text: "<tool_call>" not in text)
    text, calls, count = draw(content), [], draw(st.integers(0, 3))
    for index in range(count):
        body, call = draw(call_objects(["arguments"]))
        assume("</tool_call>" not in body)
        calls.append(call)
        if index == count - 1 and draw(st.booleans()):
            text += f"<tool_call>\n{body}"  # cut off after a complete object: still a call
        else:
            close = draw(st.sampled_from(["\n</tool_call>", "</tool_call>"]))
            text += f"<tool_call>\n{body}{close}" + draw(content)
    return text, calls


@st.composite
def llama3_outputs(draw) -> tuple[str, list[tuple[str, dict]]]:
    if draw(st.booleans()):
        return draw(st.sampled_from(["", " ", "\n"])) + "Z" + draw(content_text(["<|python_tag|>"])), []
    text = draw(st.sampled_from(["", "<|python_tag|>", " <|python_tag|>\n", "\n"]))
    calls = []
    for index in range(draw(st.integers(1, 3))):
        body, call = draw(call_objects(["parameters", "arguments"]))
        text += (draw(st.sampled_from(["; ", ";", " ; ", "\n;\n"])) if index else "") + body
        calls.append(call)
    text += draw(st.sampled_from(["", ";", " ", "; Zut", " Z{"]))
    return text, calls


@st.composite
def mistral_outputs(draw) -> tuple[str, list[tuple[str, dict]]]:
    text, calls = draw(content_text(["[TOOL_C", "[ARGS]"])), []
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            items = draw(st.lists(call_objects(["arguments"]), min_size=1, max_size=3))
            separator = draw(st.sampled_from([", ", ",", ",\n"]))
            text += f"[TOOL_CALLS]{draw(st.sampled_from(['', ' ']))}[{separator.join(body for body, _ in items)}]"
            calls += [call for _, call in items]
        else:
            name, args = draw(names), draw(arguments)
            text += f"[TOOL_CALLS]{name}[ARGS]{draw(dumps(args))}"
            calls.append((name, args))
        text += draw(content_text(["[TOOL_C", "[ARGS]"]))
    return text, calls


OUTPUTS = {"hermes": hermes_outputs(), "llama3_json": llama3_outputs(), "mistral": mistral_outputs()}


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@settings(max_examples=100)
@given(data=st.data())
def test_streams_agree_with_extract_however_split(name, data):
    text, expected = data.draw(OUTPUTS[name])
    assert calls_of(text, name) == expected
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    assert_agrees(name, text, split(text, cuts))


CALL_PIECES = [
    '{"name": "f", "arguments": {"a": 1}}',
    '{"parameters": {"b": "}"}, "name": "g"}',
    '[{"name": "h", "arguments": {}}]',
    '{"name": "f", ',
    '"arguments": {',
    '"name": 2',
    "f[ARGS]",
    "; ",
]
FUZZ = TRICKY + MARKERS * 2 + CALL_PIECES * 3


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@settings(max_examples=100)
@given(data=st.data())
def test_streams_of_arbitrary_text_stay_well_formed(name, data):
    """Any text streams without error; when the stream opens no call, extract finds none and the contents agree."""
    text = data.draw(st.lists(st.sampled_from(FUZZ), max_size=30).map("".join))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    content, calls, _ = stream(name, split(text, cuts))
    extracted = tool_parser(name)().extract(text)
    if not calls:
        assert (content, extracted.tool_calls) == (extracted.content or "", [])
