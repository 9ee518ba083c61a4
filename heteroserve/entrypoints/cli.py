"""The `heteroserve` command.

Its parser is built from modules that declare flags only (engine_args.py, chat_client.py, gateway/__init__.py,
openai/server_args.py, bench/commands.py, export/command.py), and each command imports its implementation when it
runs, so `--help`, `chat --url` and `gateway` start without loading torch or transformers.
"""

from __future__ import annotations

import argparse
import logging
import sys

from heteroserve.bench.commands import add_bench_parser
from heteroserve.engine.engine_args import EngineArgs
from heteroserve.entrypoints.chat_client import add_chat_args, run_chat
from heteroserve.entrypoints.gateway import add_gateway_args
from heteroserve.entrypoints.openai.server_args import add_server_args
from heteroserve.export.command import add_export_parser
from heteroserve.help_format import DefaultsHelpFormatter


def _serve(args: argparse.Namespace) -> None:
    from heteroserve.entrypoints.openai.api_server import run_server

    run_server(args)


def _gateway(args: argparse.Namespace) -> None:
    from heteroserve.entrypoints.gateway.app import run_gateway

    run_gateway(args)


def _env(args: argparse.Namespace) -> None:
    from heteroserve.entrypoints.env_report import print_env

    print_env(args.device, args.json)


def _build_kernels(args: argparse.Namespace) -> None:
    from pathlib import Path

    from heteroserve.platforms.cpu import kernel_variants as cpu_kernel_variants
    from heteroserve.platforms.cpu import kernels as cpu_kernels

    if args.prebuilt:
        for line in cpu_kernels.build_prebuilt(Path(args.output or cpu_kernel_variants.prebuilt_root())):
            print(line)
    elif cpu_kernels.load_library():
        print(f"CPU kernels loaded: {cpu_kernels.loaded_build()}")
    else:
        sys.exit("the CPU kernels could not be built or loaded (the warning above says why)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="heteroserve", description="LLM inference on any torch device")
    commands = parser.add_subparsers(dest="command", required=True)
    chat = commands.add_parser(
        "chat",
        help="chat in the terminal with a running server (or, with --local, the model in-process)",
        formatter_class=DefaultsHelpFormatter,
    )
    add_chat_args(chat)
    EngineArgs.add_cli_args(chat)  # for --local
    chat.set_defaults(handler=run_chat)
    add_bench_parser(commands)
    serve = commands.add_parser("serve", help="OpenAI-compatible server", formatter_class=DefaultsHelpFormatter)
    add_server_args(serve)
    serve.set_defaults(handler=_serve)
    gateway = commands.add_parser(
        "gateway",
        help="one OpenAI-compatible endpoint in front of several back ends",
        formatter_class=DefaultsHelpFormatter,
    )
    add_gateway_args(gateway)
    gateway.set_defaults(handler=_gateway)
    env = commands.add_parser("env", help="platforms, versions, CPU features and kernels of this machine")
    env.add_argument("--device", default="auto", help="the platform to describe in detail ($HETEROSERVE_DEVICE)")
    env.add_argument("--json", action="store_true", help="machine-readable output")
    env.set_defaults(handler=_env)
    kernels = commands.add_parser(
        "build-kernels",
        help="build the CPU platform's C++ kernels now rather than at the first start",
        formatter_class=DefaultsHelpFormatter,
    )
    kernels.add_argument(
        "--prebuilt",
        action="store_true",
        help="build every instruction-set level of this architecture, for machines without a compiler (images)",
    )
    kernels.add_argument(
        "--output", help="where --prebuilt writes ($HETEROSERVE_PREBUILT_KERNELS or share/heteroserve)"
    )
    kernels.set_defaults(handler=_build_kernels)
    add_export_parser(commands)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "chat" and args.max_model_len is None:
        args.max_model_len = 4096
    args.handler(args)


if __name__ == "__main__":
    main()
