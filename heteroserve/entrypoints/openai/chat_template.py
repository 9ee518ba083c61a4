"""Chat templates rendered as transformers' apply_chat_template renders them, within a deadline and a size cap.

transformers renders in a jinja2 sandbox, which keeps a template away from Python's internals but lets it loop
for minutes or build gigabytes, and a server renders in a thread that cannot be cancelled. This renderer gives
templates the same sandbox, variables, filters and globals, and compiles checks into them: every loop iteration
and every call checks the deadline; `*`, `+` and `**`, assignments, calls and the output are capped in size.
The checks bound templates the operator trusts (the model's, --chat-template) against inputs that make them slow
or huge. They do not make any template safe (a filter such as `center` or a `%` format still allocates its width
at once), which is why request templates are refused by default, and rendered in worker processes under a memory
cap when trusted (template_workers.py). A rendering is a TemplateJob, plain data, so that a worker can take it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import Context, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

if TYPE_CHECKING:  # a worker process imports this module: it renders without transformers (seconds to import)
    from transformers import PreTrainedTokenizerBase

MAX_INT_BITS = 1 << 16  # far beyond any number a template prints (Python prints at most 4300 digits)
# A long rendering pauses PAUSE_S every YIELD_INTERVAL_S so that waiting threads get the GIL: looping templates
# otherwise held every event-loop thread hop up by a switch interval (a release without a pause, sched_yield,
# only restarts the waiting thread's timer).
YIELD_INTERVAL_S = 0.001
PAUSE_S = 0.0001
# Appended to the final message under continue_final_message and found again in the output, where it is cut.
_CONTINUE_MARK = "HETEROSERVE_CONTINUE_HERE "


class TemplateLimitError(Exception):
    """A chat template ran past its deadline or built something larger than its cap."""


class TemplateTimeout(TemplateLimitError):
    pass


class TemplateTooLarge(TemplateLimitError):
    pass


@dataclass
class _Budget:
    """One rendering's deadline (time.monotonic()) and size cap, read by the checks compiled into templates."""

    deadline: float
    max_chars: int
    next_yield: float = field(default_factory=lambda: time.monotonic() + YIELD_INTERVAL_S)

    def tick(self) -> None:
        now = time.monotonic()
        if now > self.deadline:
            raise TemplateTimeout("the chat template did not finish in time")
        if now > self.next_yield:
            time.sleep(PAUSE_S)
            self.next_yield = now + YIELD_INTERVAL_S

    def check(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise TemplateTooLarge(f"{what} of {size} characters or items, over the cap of {self.max_chars}")

    def check_bits(self, bits: int) -> None:
        if bits > MAX_INT_BITS:
            raise TemplateTooLarge(f"a number of about {bits} bits, over the cap of {MAX_INT_BITS}")


_budget: ContextVar[_Budget] = ContextVar("chat_template_budget")  # set per rendering, in the rendering's thread


def _size(value: object) -> int:
    """A string's characters; a list's or tuple's items plus the characters of the strings among them."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list | tuple):
        return len(value) + sum(len(item) for item in value if isinstance(item, str))
    return 0


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with every call checking the deadline and the operators that grow values checked
    before they run (a `'x' * 10**10` is refused, not computed)."""

    intercepted_binops = frozenset({"*", "+", "**"})

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = _budget.get()
        budget.tick()
        if isinstance(getattr(obj, "__self__", None), str):  # str.center(width), ljust, zfill, ...
            for value in (*args, *kwargs.values()):
                if isinstance(value, int):
                    budget.check(value, "a string method's argument")
        result = super().call(context, obj, *args, **kwargs)
        if isinstance(result, str | list | tuple):
            budget.check(len(result), "a call's result")
        return result

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget = _budget.get()
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            budget.check_bits(left.bit_length() * right)
        elif operator == "*" and isinstance(left, int) and isinstance(right, int):
            budget.check_bits(left.bit_length() + right.bit_length())
        elif operator == "*" and isinstance(right, int):
            budget.check(_size(left) * right, "a repetition")
        elif operator == "*" and isinstance(left, int):
            budget.check(_size(right) * left, "a repetition")
        elif operator == "+":
            budget.check(_size(left) + _size(right), "a concatenation")
        return super().call_binop(context, operator, left, right)


class _Checks(Extension):
    """What compiled templates call: a deadline check per loop iteration, a size check per assignment."""

    def each(self, iterable: Iterable) -> Iterator:
        budget = _budget.get()
        for item in iterable:
            budget.tick()
            yield item

    def kept(self, value: Any) -> Any:
        _budget.get().check(_size(value), "an assignment")
        return value


class _InsertChecks(NodeTransformer):
    """Routes every `for` loop's iterable and every `set` value of a parsed template through _Checks."""

    def __init__(self, checks: _Checks) -> None:
        self.checks = checks

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = self.checks.call_method("each", [node.iter], lineno=node.lineno)
        return node

    def visit_Assign(self, node: nodes.Assign) -> nodes.Assign:
        self.generic_visit(node)
        node.node = self.checks.call_method("kept", [node.node], lineno=node.lineno)
        return node


class _GenerationTag(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's text for training
    masks): the body renders as it is, in a scope of its own as there."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Macro) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' tojson: json.dumps with its options, without jinja's HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` in templates, without handing them the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


class _Namespace(Namespace):
    """jinja's namespace(), refusing names that start with an underscore (they could shadow its internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # No named self, as in jinja's: namespace(self=1) names an attribute.
        attrs = dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        Namespace.__init__(args[0], attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")


def _environment() -> _BoundedEnvironment:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols, _Checks])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace)
    return env


_ENV = _environment()


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    tree = _ENV.parse(source)
    _InsertChecks(_ENV.extensions[_Checks.identifier]).visit(tree)
    return _ENV.from_string(tree)


@dataclass(frozen=True)
class TemplateJob:
    """One rendering: the template's source and everything it is given, all of it JSON (a worker process takes
    it as it is). `variables` are the tokenizer's special tokens and the request's chat_template_kwargs."""

    source: str
    messages: list[dict]
    variables: dict
    tools: list[dict] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False


class ChatTemplateRenderer:
    """A tokenizer's chat template (or one given instead) applied to a conversation, as transformers applies it:
    the same template choice, variables (the tokenizer's special tokens among them) and message preparation."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_chars: int) -> None:
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self.special_tokens = dict(tokenizer.special_tokens_map)

    def job(
        self,
        messages: list[dict],
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        variables: dict | None = None,
    ) -> TemplateJob:
        """The rendering of `messages` with `chat_template` (default: the tokenizer's, chosen as transformers
        chooses it, by `tools` too)."""
        return TemplateJob(
            self.tokenizer.get_chat_template(chat_template, tools),
            messages,
            {**self.special_tokens, **(variables or {})},
            tools,
            add_generation_prompt,
            continue_final_message,
        )

    def render(self, job: TemplateJob, timeout_s: float) -> str:
        """The prompt text, rendered in this thread (see render_job)."""
        return render_job(job, timeout_s, self.max_chars)


def render_job(job: TemplateJob, timeout_s: float, max_chars: int) -> str:
    """The prompt text. Raises TemplateTimeout past `timeout_s`, TemplateTooLarge past `max_chars`, and
    ValueError or jinja2's errors for a template that cannot be applied."""
    template = _compile(job.source)
    chat = [_template_message(m) for m in job.messages]
    final = _mark_final_message(chat, job.source) if job.continue_final_message else None
    context = {
        **job.variables,
        "messages": chat,
        "tools": job.tools,
        "documents": None,
        "add_generation_prompt": job.add_generation_prompt,
    }
    budget = _Budget(time.monotonic() + timeout_s, max_chars)
    token = _budget.set(budget)
    try:
        pieces, size = [], 0
        for piece in template.generate(context):
            size += len(piece)
            budget.check(size, "an output")
            pieces.append(piece)
    finally:
        _budget.reset(token)
    text = "".join(pieces)
    return text if final is None else _cut_at_mark(text, final)


def max_prompt_chars(tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> int:
    """The longest rendered prompt that could fit in max_model_len tokens: no token spans more characters than
    the vocabulary's longest, times 4 for normalizers that compose characters (NFC joins up to 4 into one)."""
    return 4 * max_model_len * max(map(len, tokenizer.get_vocab()))


def _template_message(message: dict) -> dict:
    """A message as transformers hands it to templates: no None values, and reasoning under `thinking` too (the
    name some templates read)."""
    message = {key: value for key, value in message.items() if value is not None}
    if "reasoning_content" in message:
        message = {"thinking": message["reasoning_content"], **message}
    return message


def _mark_final_message(chat: list[dict], source: str) -> str:
    """Appends the mark to the final message's (last) text, so the rendered prompt can be cut where that text
    ends; returns the text as it was."""
    final = chat[-1]
    content = final.get("content")
    if content is None:
        raise ValueError("continue_final_message: the final message has no content to continue")
    if "content" not in source:
        raise ValueError("continue_final_message: the chat template does not render the messages' content")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_MARK
        return content
    parts = list(content)
    for i in reversed(range(len(parts))):
        if "text" in parts[i]:
            text = parts[i]["text"]
            parts[i] = {**parts[i], "text": text + _CONTINUE_MARK}
            final["content"] = parts
            return text
    raise ValueError("continue_final_message: the final message has no text to continue")


def _cut_at_mark(text: str, final: str) -> str:
    """The rendered prompt up to the end of the final message (its trailing spaces kept where the template kept
    the mark's)."""
    mark = _CONTINUE_MARK.strip()
    if final.strip() not in text or mark not in text:
        raise ValueError("continue_final_message: the chat template does not render the final message as given")
    at = text.rindex(mark)
    return text[:at] if text.startswith(_CONTINUE_MARK, at) else text[:at].rstrip()
