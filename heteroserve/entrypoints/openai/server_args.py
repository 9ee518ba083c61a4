"""`heteroserve serve`'s flags: the server's own, then every engine setting (EngineArgs).

Declared apart from api_server.py so that building the `heteroserve` parser (`--help`, `chat`, `gateway`) loads
neither torch nor the server's app.
"""

from __future__ import annotations

import argparse

from heteroserve.engine.engine_args import EngineArgs
from heteroserve.entrypoints.openai.listen_address import port_number
from heteroserve.entrypoints.openai.lora_modules import parse_lora_module
from heteroserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
from heteroserve.help_format import DefaultsHelpFormatter
from heteroserve.metrics import METRICS_PREFIXES

SERVER_PREFILL_TOKENS_PER_STEP = 256


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
    group = parser.add_argument_group("server")
    group.add_argument(
        "--host",
        default="0.0.0.0",
        help="the address to listen on: every interface, as vLLM (a container's port mapping decides who reaches "
        "it); 127.0.0.1 for this machine only",
    )
    group.add_argument("--port", type=port_number, default=8000, help="checked and bound before the model loads")
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names clients use (default: a folder's or file's base name; a Hugging Face id as given)",
    )
    group.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    group.add_argument("--chat-template", default=None, help="a Jinja chat template (file path or inline)")
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept chat_template in requests (templates are code the server runs; refused by default)",
    )
    group.add_argument(
        "--chat-template-timeout", type=float, default=5.0, help="seconds one chat template rendering may take"
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": the model decides, and --tool-call-parser finds its calls in the output',
    )
    group.add_argument(
        "--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS), help="the model's tool-call format"
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served by name (PEFT folders; needs --enable-lora); also vLLM's JSON form",
    )
    group.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora and --api-key)",
    )
    group.add_argument("--allowed-origins", nargs="*", default=None, help="CORS origins, e.g. '*'")
    group.add_argument("--max-waiting-requests", type=int, default=None, help="answer 429 beyond this many waiting")
    group.add_argument(
        "--request-timeout", type=float, default=None, help="seconds a request may take, streamed or not (408)"
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=32 * 1024**2,
        help="larger request bodies answer 413 (the default fits one --max-image-bytes image in base64)",
    )
    group.add_argument(
        "--max-prompts-per-request", type=int, default=256, help="prompts one completion request may hold"
    )
    group.add_argument(
        "--metrics-prefix",
        choices=sorted(METRICS_PREFIXES),
        default="both",
        help="/metrics names: heteroserve:* (our dashboard), vllm:* (vLLM's dashboards, routers, autoscalers) or both",
    )
    group.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight work on SIGTERM")
    group.add_argument("--enable-log-requests", action="store_true", help="log request bodies (prompts included)")
    group.add_argument("--uvicorn-log-level", default="info")
    group.add_argument(
        "--log-level",
        choices=["debug", "info", "warning"],
        default="info",
        help="heteroserve's log level; debug also shows the traceback of a start-up configuration error",
    )
    media = parser.add_argument_group("images in chat requests")
    media.add_argument("--allow-remote-media", action="store_true", help="fetch http(s) image URLs (off: offline)")
    media.add_argument("--allowed-local-media-path", default=None, help="serve file:// images only under this folder")
    media.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        help="fetch remote images only from these hosts, on any address (private ones too); implies "
        "--allow-remote-media, which alone reaches only hosts with public addresses",
    )
    media.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=10.0,
        help="seconds for all of one remote image's fetch (resolution, redirects, body)",
    )
    media.add_argument("--max-image-bytes", type=int, default=20 * 1024**2, help="largest encoded image accepted")
    EngineArgs.add_cli_args(parser)
    # A server's clients wait for their first token: a burst is prefilled in steps of 256 prompt tokens, so the
    # first clients start decoding while the rest prefill, at the same throughput (README, the flag's row).
    parser.set_defaults(max_prefill_tokens_per_step=SERVER_PREFILL_TOKENS_PER_STEP)
