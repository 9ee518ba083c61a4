"""`heteroserve serve`'s settings: the server's own (ServerArgs), then every engine setting (EngineArgs).

ServerArgs declares each of the server's settings once, as EngineArgs declares the engine's: a field whose metadata
gives its flag's help and parsing, and beside it what the value must satisfy. Kept apart from api_server.py so that
building the `heteroserve` parser (`--help`, `chat`, `gateway`) loads neither torch nor the server's app.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from heteroserve.engine.engine_args import EngineArgs, cli_flag
from heteroserve.entrypoints.openai.listen_address import port_number
from heteroserve.entrypoints.openai.lora_modules import parse_lora_module
from heteroserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
from heteroserve.help_format import DefaultsHelpFormatter
from heteroserve.metrics import METRICS_PREFIXES

if TYPE_CHECKING:
    from heteroserve.config import MultimodalConfig
    from heteroserve.multimodal.media import MediaPolicy

SERVER_PREFILL_TOKENS_PER_STEP = 256
SERVER_GROUP = "server"
MEDIA_GROUP = "images in chat requests"


def _setting(
    default: Any,
    help: str | None = None,
    *,
    choices: list[str] | None = None,
    parse: Callable[[str], Any] | None = None,
    nargs: str | None = None,
    metavar: str | None = None,
    check: Callable[[Any], str | None] | None = None,
    needs: dict[str, str] | None = None,
    group: str = SERVER_GROUP,
) -> Any:
    """A field whose metadata says how its flag reads (`parse` turns one word into a value; a bool is a switch),
    what a set value must satisfy (`check` returns the problem) and which settings, the server's or the engine's,
    it `needs` set beside it (each with why, said after the message)."""
    metadata = {"help": help, "choices": choices, "parse": parse, "nargs": nargs, "metavar": metavar}
    return dataclasses.field(
        default=default, metadata={**metadata, "check": check, "needs": needs or {}, "group": group}
    )


def _positive(value: float) -> str | None:
    return None if value > 0 else "must be positive"


@dataclass
class ServerArgs:
    """One field per server setting, named as vLLM names it: `--request-timeout` is `request_timeout`."""

    host: str = _setting(
        "0.0.0.0",
        "the address to listen on: every interface, as vLLM (a container's port mapping decides who reaches it); "
        "127.0.0.1 for this machine only",
    )
    port: int = _setting(8000, "checked and bound before the model loads", parse=port_number)
    served_model_name: list[str] | None = _setting(
        None, "names clients use (default: a folder's or file's base name; a Hugging Face id as given)", nargs="+"
    )
    api_key: str | None = _setting(None, "require 'Authorization: Bearer KEY' on /v1/*")
    chat_template: str | None = _setting(None, "a Jinja chat template (file path or inline)")
    trust_request_chat_template: bool = _setting(
        False, "accept chat_template in requests (templates are code the server runs; refused by default)"
    )
    chat_template_timeout: float = _setting(5.0, "seconds one chat template rendering may take", check=_positive)
    enable_auto_tool_choice: bool = _setting(
        False,
        'tool_choice "auto": the model decides, and --tool-call-parser finds its calls in the output',
        needs={"tool_call_parser": ""},
    )
    tool_call_parser: str | None = _setting(None, "the model's tool-call format", choices=sorted(TOOL_PARSERS))
    lora_modules: list[tuple[str, str, str | None]] | None = _setting(
        None,
        "LoRA adapters served by name (PEFT folders; needs --enable-lora); also vLLM's JSON form",
        parse=parse_lora_module,
        nargs="+",
        metavar="NAME=PATH",
        needs={"enable_lora": ""},
    )
    allow_runtime_lora_updating: bool = _setting(
        False,
        "POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora and --api-key)",
        needs={"enable_lora": "", "api_key": ": it lets clients make the server read folders"},
    )
    allowed_origins: list[str] | None = _setting(None, "CORS origins, e.g. '*'", nargs="*")
    max_waiting_requests: int | None = _setting(None, "answer 429 beyond this many waiting")
    request_timeout: float | None = _setting(None, "seconds a request may take, streamed or not (408)", check=_positive)
    max_request_body_bytes: int = _setting(
        32 * 1024**2,
        "larger request bodies answer 413 (the default fits one --max-image-bytes image in base64)",
        check=_positive,
    )
    max_prompts_per_request: int = _setting(256, "prompts one completion request may hold", check=_positive)
    metrics_prefix: str = _setting(
        "both",
        "/metrics names: heteroserve:* (our dashboard), vllm:* (vLLM's dashboards, routers, autoscalers) or both",
        choices=sorted(METRICS_PREFIXES),
    )
    drain_timeout: float = _setting(30.0, "seconds to finish in-flight work on SIGTERM")
    enable_log_requests: bool = _setting(False, "log request bodies (prompts included)")
    uvicorn_log_level: str = _setting("info")
    log_level: str = _setting(
        "info",
        "heteroserve's log level; debug also shows the traceback of a start-up configuration error",
        choices=["debug", "info", "warning"],
    )
    allow_remote_media: bool = _setting(False, "fetch http(s) image URLs (off: offline)", group=MEDIA_GROUP)
    allowed_local_media_path: str | None = _setting(
        None, "serve file:// images only under this folder", group=MEDIA_GROUP
    )
    allowed_media_domains: list[str] | None = _setting(
        None,
        "fetch remote images only from these hosts, on any address (private ones too); implies "
        "--allow-remote-media, which alone reaches only hosts with public addresses",
        nargs="+",
        group=MEDIA_GROUP,
    )
    media_fetch_timeout: float = _setting(
        10.0, "seconds for all of one remote image's fetch (resolution, redirects, body)", group=MEDIA_GROUP
    )
    max_image_bytes: int = _setting(20 * 1024**2, "largest encoded image accepted", group=MEDIA_GROUP)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field (`--request-timeout` for request_timeout), in the server and media groups; a bool is
        a switch that is off unless given."""
        groups: dict[str, Any] = {}  # argument groups by title
        hints = typing.get_type_hints(cls)
        for setting in fields(cls):
            meta = setting.metadata
            if meta["group"] not in groups:
                groups[meta["group"]] = parser.add_argument_group(meta["group"])
            options: dict[str, Any] = {"default": setting.default, "help": meta["help"]}
            if hints[setting.name] is bool:
                options["action"] = "store_true"
            else:
                options["type"] = meta["parse"] or _word_type(hints[setting.name])
                for key in ("choices", "nargs", "metavar"):
                    if meta[key] is not None:
                        options[key] = meta[key]
            groups[meta["group"]].add_argument(cli_flag(setting.name), **options)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def check(self, engine: EngineArgs) -> None:
        """Each set field against its own check, then against the settings it needs (the server's or the
        engine's); the first problem is a ValueError naming the flags (run_server: one line, exit 2)."""
        for setting in fields(self):
            value = getattr(self, setting.name)
            if value is None or value is False:
                continue
            meta = setting.metadata
            problem = meta["check"](value) if meta["check"] else None
            if problem:
                raise ValueError(f"{cli_flag(setting.name)} {problem}")
            for name, why in meta["needs"].items():
                needed = getattr(self, name) if hasattr(self, name) else getattr(engine, name)
                if needed is None or needed is False:
                    raise ValueError(f"{cli_flag(setting.name)} needs {cli_flag(name)}{why}")

    def chat_template_text(self) -> str | None:
        """--chat-template as given inline, or the file it names read."""
        if self.chat_template is None:
            return None
        path = Path(self.chat_template)
        return path.read_text() if path.is_file() else self.chat_template

    def media_policy(self, multimodal: MultimodalConfig) -> MediaPolicy:
        """Where chat images may come from: the engine's pixel limits and the media flags."""
        from heteroserve.multimodal.media import MediaPolicy  # PIL: only when the server starts

        domains = self.allowed_media_domains
        return MediaPolicy.from_config(
            multimodal,
            allow_remote=self.allow_remote_media or bool(domains),
            allowed_domains=frozenset(domains) if domains else None,
            allowed_local_path=Path(self.allowed_local_media_path) if self.allowed_local_media_path else None,
            max_bytes=self.max_image_bytes,
            timeout_s=self.media_fetch_timeout,
        )


def _word_type(hint: object) -> type:
    """What argparse converts one word with: float for `float | None`, str for `list[str] | None`."""
    options = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    first = options[0]
    return typing.get_args(first)[0] if typing.get_origin(first) is list else first


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="heteroserve serve",
        description="OpenAI-compatible LLM server",
        formatter_class=DefaultsHelpFormatter,
    )
    add_server_args(parser)
    return parser


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, help="model (default: the embedded SmolLM2-135M)")
    parser.add_argument("--model", default=None, help="same as the positional MODEL")
    ServerArgs.add_cli_args(parser)
    EngineArgs.add_cli_args(parser)
    # A server's clients wait for their first token: a burst is prefilled in steps of 256 prompt tokens, so the
    # first clients start decoding while the rest prefill, at the same throughput (README, the flag's row).
    parser.set_defaults(max_prefill_tokens_per_step=SERVER_PREFILL_TOKENS_PER_STEP)
