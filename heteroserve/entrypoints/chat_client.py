"""`heteroserve chat`: a terminal chat with a running server, answers streamed as they arrive.

The server is reached over its OpenAI API (`POST /v1/chat/completions` with `stream: true`, read as server-sent
events); `--local MODEL` runs the model in this process instead and streams its tokens from the engine's steps.

Input: a line ending in `\\` goes on to the next line; a line holding only `\"\"\"` opens a block that the next such
line closes. Commands: /help, /clear (the conversation, the system prompt kept), /save FILE (the conversation as
JSON), /exit (or Ctrl-D). Ctrl-C during an answer stops it (the stream is closed, so the server aborts the
request): what arrived stays in the conversation, marked `"interrupted": true` in /save's file (an answer
stopped before its first token is dropped with its question). Ctrl-C at the prompt discards the line; a second
one in a row exits.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import httpx

HELP = """\
/help         this text
/clear        forget the conversation (the system prompt stays)
/save FILE    write the conversation as JSON ({"model", "messages"}: the body of a chat request)
/exit         quit (so does Ctrl-D)
A line ending in \\ continues on the next line; a line holding only \"\"\" opens or closes a block.
Ctrl-C stops an answer; at the prompt it discards the line, and twice in a row it exits."""

PROMPT, CONTINUATION = "user> ", "... "
BLOCK = '"""'
DIM, RESET = "\x1b[2m", "\x1b[0m"


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    """The client's flags; the engine's flags (EngineArgs.add_cli_args) apply with --local only."""
    parser.add_argument("--url", default="http://localhost:8000", help="the server (with or without /v1)")
    parser.add_argument(
        "--api-key",
        default=None,  # read from the environment at run time, so that --help never shows a key
        help="sent as 'Authorization: Bearer KEY' (unset: $HETEROSERVE_API_KEY, then $OPENAI_API_KEY)",
    )
    parser.add_argument("--model", default=None, help="the served model to ask (default: the first of /v1/models)")
    parser.add_argument("--system-prompt", default=None, help="the conversation's first, system message")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    parser.add_argument("--max-tokens", type=int, default=None, help="longest answer (default: the server's)")
    parser.add_argument("--prompt", action="append", help="ask this and exit (repeatable)")
    parser.add_argument("--no-color", action="store_true", help="no terminal colours (also $NO_COLOR)")
    parser.add_argument(
        "--local",
        nargs="?",
        const="",
        default=None,
        metavar="MODEL",
        help="run MODEL in this process instead of asking a server (no MODEL: the default model)",
    )


class ChatError(Exception):
    """A request the server refused or could not answer; the conversation goes on."""


class Unreachable(ChatError):
    """No connection to the server at all."""


class Backend(Protocol):
    model: str

    def stream(self, messages: list[dict], sampling: dict) -> Iterator[dict]:
        """The answer's deltas in OpenAI's shape (content, reasoning_content, tool_calls), as they arrive."""
        ...


class ServerBackend:
    """A server's /v1/chat/completions, streamed."""

    def __init__(self, url: str, api_key: str | None, model: str | None) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No read deadline: a long prefill is silent, and Ctrl-C stops a wait that is too long.
        self.client = httpx.Client(headers=headers, timeout=httpx.Timeout(10.0, read=None))
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        response = self._send("GET", "/v1/models")
        models = response.json().get("data") or []
        if not models:
            raise ChatError(f"the server at {self.url} serves no model")
        return models[0]["id"]

    def _send(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            response = self.client.request(method, self.url + path, **kwargs)
        except httpx.TransportError as exc:
            raise Unreachable(f"cannot reach the server at {self.url}: {exc or type(exc).__name__}") from exc
        if response.status_code >= 400:
            raise ChatError(_error_message(response))
        return response

    def stream(self, messages: list[dict], sampling: dict) -> Iterator[dict]:
        body = {"model": self.model, "messages": messages, "stream": True, **sampling}
        try:
            with self.client.stream("POST", self.url + "/v1/chat/completions", json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise ChatError(_error_message(response))
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators and ': comments'
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    try:
                        chunk = json.loads(data)
                    except ValueError as exc:
                        raise ChatError(f"the server sent an unreadable event: {data[:200]}") from exc
                    if "error" in chunk:
                        raise ChatError(chunk["error"].get("message") or str(chunk["error"]))
                    for choice in chunk.get("choices") or []:
                        yield choice.get("delta") or {}
        except httpx.TransportError as exc:
            raise Unreachable(f"lost the server at {self.url}: {exc or type(exc).__name__}") from exc


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json()["error"]
        message = error["message"] if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        message = response.text.strip() or response.reason_phrase
    return f"HTTP {response.status_code}: {message}"


class LocalBackend:
    """The model in this process: the engine stepped here, its text deltas streamed."""

    def __init__(self, model: str | None, args: argparse.Namespace) -> None:
        from heteroserve.engine.engine_args import EngineArgs
        from heteroserve.entrypoints.llm import LLM

        self.llm = LLM.from_config(EngineArgs.from_cli_args(args, model or None).create_engine_config())
        self.model = model or "default model"
        self._ids = itertools.count()

    def stream(self, messages: list[dict], sampling: dict) -> Iterator[dict]:
        from heteroserve.sampling_params import RequestOutputKind

        engine, tokenizer = self.llm.engine, self.llm.engine.model.tokenizer
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
        params = engine.processor.default_sampling_params().clone(
            max_tokens=sampling.get("max_tokens"), output_kind=RequestOutputKind.DELTA
        )
        if "temperature" in sampling:
            params = params.clone(temperature=sampling["temperature"])
        request_id = f"chat-{next(self._ids)}"
        with _stop_on_sigint() as stopped:
            try:
                engine.add_request(request_id, prompt, params)
            except ValueError as exc:
                raise ChatError(str(exc)) from exc
            finished = False
            try:
                while not finished and not stopped():
                    for output in engine.step():
                        finished = finished or output.finished
                        if output.outputs[0].text:
                            yield {"content": output.outputs[0].text}
            finally:
                if not finished:  # interrupted, or the reader stopped: free the request's blocks
                    engine.abort_request(request_id)
                    engine.step()
        if not finished:
            raise KeyboardInterrupt


@contextlib.contextmanager
def _stop_on_sigint() -> Iterator:
    """Ctrl-C sets a flag read between engine steps, instead of raising in the middle of one."""
    pressed = []
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
    try:
        yield lambda: bool(pressed)
    finally:
        signal.signal(signal.SIGINT, previous)


class AnswerPrinter:
    """Writes an answer's deltas as they come: reasoning dimmed (or after 'thinking: '), then the content, then
    the tool calls once they are whole. It also gathers the assistant message for the conversation."""

    def __init__(self, color: bool) -> None:
        self.color = color
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, dict] = {}

    def feed(self, delta: dict) -> None:
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            if not self.reasoning:
                self._write(DIM if self.color else "thinking: ")
            self.reasoning.append(reasoning)
            self._write(reasoning)
        if delta.get("content"):
            if self.reasoning and not self.content:
                self._write(RESET + "\n" if self.color else "\n")
            self.content.append(delta["content"])
            self._write(delta["content"])
        for call in delta.get("tool_calls") or []:
            whole = self.tool_calls.setdefault(
                call.get("index", 0), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            whole["id"] = call.get("id") or whole["id"]
            function = call.get("function") or {}
            whole["function"]["name"] += function.get("name") or ""
            whole["function"]["arguments"] += function.get("arguments") or ""

    def finish(self) -> None:
        if self.color and self.reasoning and not self.content:
            self._write(RESET)
        for call in self.tool_calls.values():
            self._write(f"\n[tool call] {call['function']['name']}({call['function']['arguments']})")
        self._write("\n")

    def received(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def message(self) -> dict:
        message: dict = {"role": "assistant", "content": "".join(self.content)}
        if self.tool_calls:
            message["tool_calls"] = list(self.tool_calls.values())
        return message

    @staticmethod
    def _write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()


class Conversation:
    """The messages so far, after the optional system prompt."""

    def __init__(self, system_prompt: str | None) -> None:
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.messages: list[dict] = list(self.system)

    def clear(self) -> None:
        self.messages = list(self.system)

    def for_request(self) -> list[dict]:
        """The messages as the server takes them (without our 'interrupted' marks)."""
        return [{k: v for k, v in m.items() if k != "interrupted"} for m in self.messages]

    def save(self, path: Path, model: str) -> None:
        path.write_text(json.dumps({"model": model, "messages": self.messages}, indent=2, ensure_ascii=False) + "\n")


def read_message(echo: bool) -> str | None:
    """One message from the user (continued lines and \"\"\" blocks joined); None at end of input."""
    lines: list[str] = []
    prompt, in_block = PROMPT, False
    while True:
        try:
            line = input(prompt)
        except EOFError:
            return "\n".join(lines) if lines else None
        if echo:
            print(line, flush=True)
        if line.strip() == BLOCK:
            if in_block:
                return "\n".join(lines)
            in_block, prompt = True, CONTINUATION
        elif in_block:
            lines.append(line)
        elif line.endswith("\\"):
            lines.append(line[:-1])
            prompt = CONTINUATION
        else:
            lines.append(line)
            return "\n".join(lines)


def ask(backend: Backend, conversation: Conversation, question: str, sampling: dict, color: bool) -> None:
    """Streams one answer; a refused request leaves the conversation as it was."""
    conversation.messages.append({"role": "user", "content": question})
    printer = AnswerPrinter(color)
    deltas = backend.stream(conversation.for_request(), sampling)
    try:
        with contextlib.closing(deltas):  # closed at once when stopped: the server sees the client leave
            for delta in deltas:
                printer.feed(delta)
    except KeyboardInterrupt:
        printer.finish()
        print("[interrupted]", file=sys.stderr, flush=True)
        if printer.received():
            conversation.messages.append({**printer.message(), "interrupted": True})
        else:
            conversation.messages.pop()
        return
    except ChatError:
        if printer.received():
            printer.finish()
        conversation.messages.pop()
        raise
    printer.finish()
    conversation.messages.append(printer.message())


def run_command(line: str, conversation: Conversation, model: str) -> bool:
    """A /command; False when it asks to quit."""
    name, _, rest = line.partition(" ")
    if name in ("/exit", "/quit"):
        return False
    if name == "/help":
        print(HELP)
    elif name == "/clear":
        conversation.clear()
        print("(conversation cleared)")
    elif name == "/save":
        if not rest.strip():
            print("usage: /save FILE", file=sys.stderr)
        else:
            try:
                conversation.save(Path(rest.strip()).expanduser(), model)
                print(f"(saved {len(conversation.messages)} messages to {rest.strip()})")
            except OSError as exc:
                print(f"error: {exc}", file=sys.stderr)
    else:
        print(f"unknown command {name}; /help lists them", file=sys.stderr)
    sys.stdout.flush()
    return True


def run_chat(args: argparse.Namespace) -> None:
    """The command: connects (or loads the model), then asks --prompt questions or reads the user's."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would break into the answers
    color = sys.stdout.isatty() and not args.no_color and not os.environ.get("NO_COLOR")
    sampling = {k: v for k, v in (("temperature", args.temperature), ("max_tokens", args.max_tokens)) if v is not None}
    api_key = args.api_key or os.environ.get("HETEROSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY")
    try:
        backend = (
            LocalBackend(args.local, args) if args.local is not None else ServerBackend(args.url, api_key, args.model)
        )
    except ChatError as exc:
        sys.exit(f"error: {exc}")
    conversation = Conversation(args.system_prompt)
    if args.prompt:
        for question in args.prompt:
            print(f"{PROMPT}{question}", flush=True)
            try:
                ask(backend, conversation, question, sampling, color)
            except ChatError as exc:
                sys.exit(f"error: {exc}")
        return
    if sys.stdin.isatty():
        print(f"chatting with {backend.model}; /help for commands", flush=True)
    interrupted = False
    while True:
        try:
            line = read_message(echo=not sys.stdin.isatty())
        except KeyboardInterrupt:
            if interrupted:
                print(flush=True)
                return
            interrupted = True
            print("\n(Ctrl-C again to exit)", flush=True)
            continue
        interrupted = False
        if line is None:
            print(flush=True)
            return
        if not line.strip():
            continue
        if line.startswith("/") and "\n" not in line:
            if not run_command(line.strip(), conversation, backend.model):
                return
            continue
        try:
            ask(backend, conversation, line, sampling, color)
        except ChatError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
