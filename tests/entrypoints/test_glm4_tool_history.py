"""An OpenAI tool-call history reaching GLM-4's templates in their own form (the glm4 parser's
`template_messages`): each call an assistant turn with `metadata`, each result an `observation` turn after its call,
the tools where glm-4-9b-chat's template reads them; a history that form cannot hold is a 400. Rendered through
`ServingChat.render` (no engine, no server) and compared byte for byte with transformers on the hand-written form.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from heteroserve.entrypoints.openai.errors import APIError
from heteroserve.entrypoints.openai.protocol import ChatCompletionRequest
from heteroserve.entrypoints.openai.serving import ServerSettings
from heteroserve.entrypoints.openai.serving_chat import ServingChat
from heteroserve.entrypoints.openai.tool_parsers import tool_parser
from tests.entrypoints.test_family_templates import GLM, SYSTEM, TEMPLATES, WEATHER, tokenizer


def call(call_id: str, name: str, arguments: object) -> dict:
    """A tool call as a template message holds it (arguments as an object)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def mapped(messages: list[dict], tools: list[dict] | None = None) -> list[dict]:
    return tool_parser("glm4").template_messages(messages, tools)


USER = {"role": "user", "content": "Weather in Zürich and Paris?"}
ZURICH = call("call_1", "get_weather", {"city": "Zürich", "days": 2})
PARIS = call("call_2", "get_weather", {"city": "Paris"})
ZURICH_TURN = {"role": "assistant", "metadata": "get_weather", "content": '{"city": "Zürich", "days": 2}'}
PARIS_TURN = {"role": "assistant", "metadata": "get_weather", "content": '{"city": "Paris"}'}

MAPPINGS = {
    "one call, its result, the answer": (
        [
            USER,
            {"role": "assistant", "content": "", "tool_calls": [ZURICH]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
            {"role": "assistant", "content": "3 °C."},
        ],
        [
            USER,
            ZURICH_TURN,
            {"role": "observation", "content": '{"temp": 3}'},
            {"role": "assistant", "content": "3 °C."},
        ],
    ),
    "text before the calls is a turn of its own": (
        [USER, {"role": "assistant", "content": "Let me look.", "tool_calls": [ZURICH]}],
        [USER, {"role": "assistant", "content": "Let me look."}, ZURICH_TURN],
    ),
    "each result follows the call its tool_call_id names": (
        [
            {"role": "assistant", "content": "  ", "tool_calls": [ZURICH, PARIS]},
            {"role": "tool", "tool_call_id": "call_2", "content": "11"},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        ],
        [
            ZURICH_TURN,
            {"role": "observation", "content": "3"},
            PARIS_TURN,
            {"role": "observation", "content": "11"},
        ],
    ),
    "results without tool_call_id answer the calls in order": (
        [
            {"role": "assistant", "content": "", "tool_calls": [ZURICH, PARIS]},
            {"role": "tool", "content": "3"},
            {"role": "tool", "content": "11"},
        ],
        [ZURICH_TURN, {"role": "observation", "content": "3"}, PARIS_TURN, {"role": "observation", "content": "11"}],
    ),
    "a call not answered yet stays a call": (
        [
            {"role": "assistant", "content": "", "tool_calls": [ZURICH, PARIS]},
            {"role": "tool", "tool_call_id": "call_2", "content": "11"},
        ],
        [ZURICH_TURN, PARIS_TURN, {"role": "observation", "content": "11"}],
    ),
    "arguments that are not JSON stay the text they are": (
        [{"role": "assistant", "content": "", "tool_calls": [call("c", "run", "ls -l")]}],
        [{"role": "assistant", "metadata": "run", "content": "ls -l"}],
    ),
    "the message's other fields stay on its first turn": (
        [{"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [ZURICH]}],
        [{**ZURICH_TURN, "reasoning_content": "Look it up."}],
    ),
    "a history without calls is unchanged": ([SYSTEM, USER], [SYSTEM, USER]),
}


@pytest.mark.parametrize(("history", "expected"), MAPPINGS.values(), ids=MAPPINGS)
def test_openai_history_maps_to_glm4_turns(history, expected):
    assert mapped(history) == expected


def test_the_tools_go_on_the_first_turn():
    assert mapped([SYSTEM, USER], [WEATHER]) == [{**SYSTEM, "tools": [WEATHER]}, USER]


def test_other_parsers_leave_the_history_as_it_is():
    history = [USER, {"role": "assistant", "content": "", "tool_calls": [ZURICH]}, {"role": "tool", "content": "3"}]
    assert tool_parser("hermes").template_messages(history, [WEATHER]) is history


UNWRITABLE = {
    "a tool message first": (
        [{"role": "tool", "content": "3"}, USER],
        r"messages\[0\] is a tool message that follows no",
    ),
    "a tool message after a user's": (
        [{"role": "assistant", "content": "", "tool_calls": [ZURICH]}, USER, {"role": "tool", "content": "3"}],
        r"messages\[2\] is a tool message that follows no assistant message with tool_calls",
    ),
    "an id no call has": (
        [{"role": "assistant", "content": "", "tool_calls": [ZURICH]}, {"role": "tool", "tool_call_id": "x"}],
        r"messages\[1\] answers call 'x', which messages\[0\] does not make",
    ),
    "a call answered twice": (
        [
            {"role": "assistant", "content": "", "tool_calls": [ZURICH]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"},
            {"role": "tool", "tool_call_id": "call_1", "content": "4"},
        ],
        r"messages\[2\] answers call 'call_1' of messages\[0\] a second time",
    ),
    "more results than calls": (
        [
            {"role": "assistant", "content": "", "tool_calls": [ZURICH]},
            {"role": "tool", "content": "3"},
            {"role": "tool", "content": "4"},
        ],
        r"messages\[2\] is a tool message without tool_call_id, and every call of messages\[0\] is answered",
    ),
}


@pytest.mark.parametrize(("history", "problem"), UNWRITABLE.values(), ids=UNWRITABLE)
def test_a_history_the_form_cannot_hold_is_refused(history, problem):
    with pytest.raises(ValueError, match=problem):
        mapped(history)


# --- through the server's renderer -------------------------------------------------------------------------------

AGENT_LOOP = [
    SYSTEM,
    USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 11}'},
    {"role": "assistant", "content": "Zürich 3 °C, Paris 11 °C."},
    {"role": "user", "content": "Thanks"},
]
GLM_FORM = [
    SYSTEM,
    USER,
    {"role": "assistant", "metadata": "get_weather", "content": '{"city": "Zürich"}'},
    {"role": "observation", "content": '{"temp": 3}'},
    {"role": "assistant", "metadata": "get_weather", "content": '{"city": "Paris"}'},
    {"role": "observation", "content": '{"temp": 11}'},
    {"role": "assistant", "content": "Zürich 3 °C, Paris 11 °C."},
    {"role": "user", "content": "Thanks"},
]


def serving(template: str, parser: str | None = "glm4") -> ServingChat:
    """The chat endpoint's serving object with the template and parser, over an engine that only has a tokenizer."""
    model = SimpleNamespace(tokenizer=tokenizer(GLM), max_model_len=4096, sampling_defaults=None)
    engine = SimpleNamespace(model=model)
    source = (TEMPLATES / f"{template}.jinja").read_text()
    settings = ServerSettings(["glm-4"], chat_template=source, tool_call_parser=parser)
    return ServingChat(engine, settings, metrics=None, admission=None)


def rendered(chat: ServingChat, messages: list[dict], tools: list[dict] | None = None) -> str:
    body = {"messages": messages, **({"tools": tools} if tools else {})}
    text, _, _ = chat.render(ChatCompletionRequest.model_validate(body), None, time.monotonic() + 5)
    return text


@pytest.mark.parametrize(
    ("template", "glm_form", "call", "result"),
    [
        pytest.param(
            "glm-4-9b-0414",
            GLM_FORM,
            '<|assistant|>get_weather \n{"city": "Zürich"}',
            '<|observation|>\n{"temp": 3}<|assistant|>get_weather \n{"city": "Paris"}<|observation|>\n{"temp": 11}',
            id="glm-4-9b-0414",
        ),
        pytest.param(
            "glm-4-9b-chat-hf",
            [{**GLM_FORM[0], "tools": [WEATHER]}, *GLM_FORM[1:]],
            '<|assistant|>get_weather\n{"city": "Zürich"}',
            '<|observation|>\n{"temp": 3}<|assistant|>get_weather\n{"city": "Paris"}<|observation|>\n{"temp": 11}',
            id="glm-4-9b-chat-hf",
        ),
    ],
)
def test_an_agent_loop_renders_as_transformers_renders_its_glm_form(template, glm_form, call, result):
    source = (TEMPLATES / f"{template}.jinja").read_text()
    expected = tokenizer(GLM).apply_chat_template(
        glm_form, tools=[WEATHER], chat_template=source, tokenize=False, add_generation_prompt=True
    )
    prompt = rendered(serving(template), AGENT_LOOP, [WEATHER])
    assert prompt.encode() == expected.encode()
    assert call + result in prompt
    assert "## get_weather" in prompt  # the tools, which glm-4-9b-chat's template reads from the first message
    assert prompt.endswith("<|user|>\nThanks<|assistant|>")


def test_without_the_glm4_parser_the_template_drops_the_calls():
    """What the mapping is for: GLM-4-0414's template given the OpenAI form writes neither call nor result."""
    prompt = rendered(serving("glm-4-9b-0414", parser="hermes"), AGENT_LOOP, [WEATHER])
    assert "<|assistant|>get_weather" not in prompt and "<|observation|>" not in prompt


def test_a_history_the_form_cannot_hold_is_a_400():
    messages = [USER, {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    with pytest.raises(APIError) as refused:
        rendered(serving("glm-4-9b-0414"), messages, [WEATHER])
    assert (refused.value.status, refused.value.param) == (400, "messages")
    assert "messages[1] is a tool message that follows no assistant message with tool_calls" in str(refused.value)
