"""`heteroserve gateway`: one OpenAI-compatible endpoint in front of several back ends (heteroserve or any
OpenAI-compatible server), with routing, balancing, health checks and retries.

The package holds only the command's flags, so that building the `heteroserve` parser loads no web framework;
app.py holds the app and `run_gateway`.
"""

from __future__ import annotations

import argparse


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the gateway's YAML file (deploy/gateway.example.yaml)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight requests on SIGTERM"
    )
    parser.add_argument("--uvicorn-log-level", default="info")
