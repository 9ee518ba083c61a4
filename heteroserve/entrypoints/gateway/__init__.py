"""`heteroserve gateway`: one OpenAI-compatible endpoint in front of several back ends (heteroserve or any
OpenAI-compatible server), with routing, balancing, health checks and retries."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from heteroserve.entrypoints.gateway.app import Gateway, build_app
from heteroserve.entrypoints.gateway.config import ConfigError
from heteroserve.entrypoints.openai.api_server import DrainingServer


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the gateway's YAML file (deploy/gateway.example.yaml)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight requests on SIGTERM"
    )
    parser.add_argument("--uvicorn-log-level", default="info")


def run_gateway(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health check
    try:
        gateway = Gateway(args.config)
    except ConfigError as exc:
        raise SystemExit(f"invalid gateway config: {exc}") from None
    app = build_app(gateway)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=5
    )
    DrainingServer(config, app.state.server, args.drain_timeout).run()  # SIGTERM drains, as the server does
