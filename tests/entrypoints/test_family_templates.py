"""Each new family's own chat template (tests/entrypoints/templates, sources in its README) renders through the
server's path, request -> template messages -> ChatTemplateRenderer, byte-identically to transformers'
apply_chat_template on the same conversation: plain turns, tools, tool calls and results, reasoning, the
template's own switches (enable_thinking, thinking), continue_final_message, and the errors a template raises.

A conversation is written once as transformers takes it (tool-call arguments as objects); the request the server
gets is the OpenAI form of it (arguments as JSON text, content null beside tool calls).
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from heteroserve.entrypoints.openai.chat_template import ChatTemplateRenderer
from heteroserve.entrypoints.openai.protocol import ChatCompletionRequest
from heteroserve.entrypoints.openai.serving_chat import ServingChat, template_options
from heteroserve.entrypoints.openai.template_workers import TemplateWorkers, _stop

TEMPLATES = Path(__file__).parent / "templates"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "units": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["city"],
        },
    },
}

SYSTEM = {"role": "system", "content": "You are terse."}
CHAT = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "  Hello! How can I help?  "},
    {"role": "user", "content": "Name a prime number.\nJust one."},
]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Zürich and Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two cities, two calls.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2, "units": ["c"]}},
            },
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 11}'},
    {"role": "assistant", "content": "Zürich 3 °C, Paris 11 °C.", "reasoning_content": "Both answered."},
    {"role": "user", "content": "Thanks"},
]
CONTINUED = [*CHAT, {"role": "assistant", "content": "The answer is"}]


def case(template, tokens, conversation, tools=None, **options):
    name = "-".join(
        [
            template,
            f"{len(conversation)}turns",
            *(["tools"] if tools else []),
            *(f"{k}={v}" for k, v in options.items()),
        ]
    )
    return pytest.param(template, tokens, conversation, tools, options, id=name)


GEMMA = {"bos_token": "<bos>", "eos_token": "<eos>"}
PHI = {"bos_token": "<s>", "eos_token": "<|endoftext|>"}
OLMO = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
ERNIE = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "cls_token": "<|begin_of_sentence|>",
    "sep_token": "<|end_of_sentence|>",
}
QWEN = {"eos_token": "<|im_end|>"}
GLM = {"eos_token": "<|endoftext|>"}
GRANITE = {"bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>"}
PHI4 = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}

CASES = [
    case("gemma-2-2b-it", GEMMA, CHAT),
    case("gemma-2-2b-it", GEMMA, CHAT[:2], add_generation_prompt=False),
    case("gemma-2-2b-it", GEMMA, CHAT[:2], continue_final_message=True),
    case("phi-3.5-mini-instruct", PHI, [SYSTEM, *CHAT]),
    case("phi-3.5-mini-instruct", PHI, [SYSTEM, *CHAT[:2]], add_generation_prompt=False),
    case("phi-3.5-mini-instruct", PHI, CONTINUED, continue_final_message=True),
    case("olmo-2-1124-13b-instruct", OLMO, [SYSTEM, *CHAT]),
    case("olmo-2-1124-13b-instruct", OLMO, [SYSTEM, *CHAT[:2]], add_generation_prompt=False),
    case("ernie-4.5-0.3b-pt", ERNIE, [SYSTEM, *CHAT]),
    case("ernie-4.5-0.3b-pt", ERNIE, CONTINUED, continue_final_message=True),
    case("qwen3-0.6b", QWEN, [SYSTEM, *CHAT]),
    case("qwen3-0.6b", QWEN, [SYSTEM, *TOOL_TURNS], tools=[WEATHER]),
    case("qwen3-0.6b", QWEN, TOOL_TURNS[:4], tools=[WEATHER], enable_thinking=False),
    case("glm-4.6", GLM, [SYSTEM, *CHAT]),
    case("glm-4.6", GLM, [SYSTEM, *TOOL_TURNS], tools=[WEATHER]),
    case("glm-4.6", GLM, TOOL_TURNS[:4], tools=[WEATHER], enable_thinking=False),
    case("glm-4.6", GLM, CONTINUED, continue_final_message=True),
    case("granite-3.3-2b-instruct", GRANITE, [SYSTEM, *CHAT]),
    case("granite-3.3-2b-instruct", GRANITE, CHAT, thinking=True),
    case("granite-3.3-2b-instruct", GRANITE, TOOL_TURNS, tools=[WEATHER]),
    case("gemma-3-it", GEMMA, [SYSTEM, *CHAT]),
    case("gemma-3-it", GEMMA, CHAT[:2], add_generation_prompt=False),
    case("gemma-3-it", GEMMA, CONTINUED, continue_final_message=True),
    case("phi-4-mini-instruct", PHI4, [SYSTEM, *CHAT]),
    case("phi-4-mini-instruct", PHI4, [SYSTEM, *CHAT[:2]], add_generation_prompt=False),
    case("phi-4-mini-instruct", PHI4, CONTINUED, continue_final_message=True),
    case("phi-4-mini-instruct", PHI4, [SYSTEM, *TOOL_TURNS], tools=[WEATHER]),
    case("glm-4-9b-0414", GLM, [SYSTEM, *CHAT]),
    case("glm-4-9b-0414", GLM, [SYSTEM, *TOOL_TURNS], tools=[WEATHER]),
    case("glm-4-9b-0414", GLM, CONTINUED, continue_final_message=True),
    case("glm-4-9b-chat-hf", GLM, [SYSTEM, *CHAT]),
    case("glm-4-9b-chat-hf", GLM, [SYSTEM, *TOOL_TURNS], tools=[WEATHER]),
    case("glm-4-9b-chat-hf", GLM, CONTINUED, continue_final_message=True),
]


def tokenizer(tokens: dict[str, str]) -> PreTrainedTokenizerFast:
    """A tokenizer that knows only its special tokens: all a template sees of it."""
    vocab = {token: i for i, token in enumerate(dict.fromkeys(["<unk>", *tokens.values()]))}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>", **tokens
    )


def openai_form(message: dict) -> dict:
    """The message as an OpenAI client sends it: arguments as JSON text, no content beside tool calls."""
    if "tool_calls" not in message:
        return message
    calls = [
        {**call, "function": {**call["function"], "arguments": json.dumps(call["function"]["arguments"])}}
        for call in message["tool_calls"]
    ]
    return {**message, "content": message["content"] or None, "tool_calls": calls}


def served(renderer, source: str, conversation, tools, options, templates: ChatTemplateRenderer | None = None) -> str:
    """The prompt the server renders for this conversation: ServingChat.render's steps, without an engine.
    `renderer` renders the job `templates` (default: the renderer itself) builds, as the server's worker
    processes render a request's template."""
    flags = {key: options.pop(key) for key in ("add_generation_prompt", "continue_final_message") if key in options}
    body = {"messages": [openai_form(m) for m in conversation], **flags}
    if tools:
        body["tools"] = tools
    if options:
        body["chat_template_kwargs"] = options
    request = ChatCompletionRequest.model_validate(body)
    messages = [ServingChat._template_message(m) for m in request.messages]
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
    job = (templates or renderer).job(messages, chat_template=source, tools=tools, **template_options(request))
    return renderer.render(job, timeout_s=5.0)


@pytest.mark.parametrize(("template", "tokens", "conversation", "tools", "options"), CASES)
def test_family_template_renders_as_transformers_does(template, tokens, conversation, tools, options):
    source = (TEMPLATES / f"{template}.jinja").read_text()
    reference = tokenizer(tokens)
    flags = {"add_generation_prompt": True, **options}
    if flags.get("continue_final_message"):
        flags["add_generation_prompt"] = False
    expected = reference.apply_chat_template(conversation, tools=tools, chat_template=source, tokenize=False, **flags)
    rendered = served(ChatTemplateRenderer(reference, max_chars=1 << 20), source, conversation, tools, dict(options))
    assert rendered == expected
    assert rendered.encode() == expected.encode()


def test_a_template_refusing_a_conversation_refuses_it_in_both():
    source = (TEMPLATES / "gemma-2-2b-it.jinja").read_text()
    reference = tokenizer(GEMMA)
    with pytest.raises(jinja2.TemplateError, match="System role not supported") as expected:
        reference.apply_chat_template([SYSTEM, *CHAT], chat_template=source, tokenize=False)
    renderer = ChatTemplateRenderer(reference, max_chars=1 << 20)
    with pytest.raises(jinja2.TemplateError) as raised:
        served(renderer, source, [SYSTEM, *CHAT], None, {})
    assert str(raised.value) == str(expected.value)


def test_request_templates_render_the_same_in_worker_processes():
    """A request's own template (--trust-request-chat-template) renders in a worker process, its job sent as JSON."""
    source = (TEMPLATES / "glm-4.6.jinja").read_text()
    reference = tokenizer(GLM)
    conversation = [SYSTEM, *TOOL_TURNS[:4]]
    expected = reference.apply_chat_template(
        conversation, tools=[WEATHER], chat_template=source, tokenize=False, add_generation_prompt=True
    )
    workers = TemplateWorkers(1, max_chars=1 << 20)
    try:
        assert (
            served(workers, source, conversation, [WEATHER], {}, ChatTemplateRenderer(reference, 1 << 20)) == expected
        )
    finally:
        _stop(workers.idle.get())


def test_glm4_0414_renders_a_tool_call_history_in_its_own_form():
    """GLM-4-0414's template writes a call from an assistant turn whose `metadata` is the function's name and whose
    content is the arguments' JSON, and a result from an `observation` turn; OpenAI `tool_calls` and `tool` turns it
    drops (the cases above), so this is the form a GLM-4-0414 history has to reach it in."""
    source = (TEMPLATES / "glm-4-9b-0414.jinja").read_text()
    reference = tokenizer(GLM)
    conversation = [
        SYSTEM,
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "metadata": "get_weather", "content": '{"city": "Zürich", "days": 2}'},
        {"role": "observation", "content": '{"temp": 3}'},
        {"role": "assistant", "content": "3 °C."},
        {"role": "user", "content": "Thanks"},
    ]
    expected = reference.apply_chat_template(
        conversation, tools=[WEATHER], chat_template=source, tokenize=False, add_generation_prompt=True
    )
    assert '<|assistant|>get_weather \n{"city": "Zürich", "days": 2}<|observation|>\n{"temp": 3}' in expected
    renderer = ChatTemplateRenderer(reference, max_chars=1 << 20)
    job = renderer.job(conversation, chat_template=source, tools=[WEATHER], add_generation_prompt=True)
    assert renderer.render(job, timeout_s=5.0) == expected
