"""The gateway's HTTP app: OpenAI-compatible routes in front of the back ends, probes, metrics, the chat
page, the config reload on SIGHUP, and the in-flight count the SIGTERM drain waits on."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from heteroserve.entrypoints.gateway.backends import check_all
from heteroserve.entrypoints.gateway.config import ConfigError, load_config
from heteroserve.entrypoints.gateway.metrics import GatewayMetrics
from heteroserve.entrypoints.gateway.proxy import Proxy
from heteroserve.entrypoints.gateway.router import Router, Target
from heteroserve.entrypoints.openai.draining_server import DrainingServer
from heteroserve.entrypoints.openai.errors import APIError
from heteroserve.entrypoints.openai.gate import ServerState
from heteroserve.entrypoints.openai.page_routes import add_chat_page_routes

logger = logging.getLogger("heteroserve.gateway")


class Gateway:
    """The live config and router. A reload swaps both in one step; requests already forwarded keep the
    back-end objects they hold, so nothing in flight is dropped."""

    def __init__(self, path: str | Path) -> None:
        self.path = path
        self.config = load_config(path)
        self.router = Router(self.config)

    def reload(self) -> None:
        try:
            config = load_config(self.path)
        except ConfigError as exc:
            logger.error("reload refused, keeping the running config: %s", exc)
            return
        self.router, self.config = Router(config, self.router.backends), config
        logger.info("config reloaded: %d back ends, %d routes", len(config.backends), len(config.routes))

    def service_class(self, request: Request) -> str | None:
        """Checks the gateway API key (when any is configured) and returns the request's service class:
        the X-Service-Class header, else the key's default, else the gateway's."""
        keys = {k.key: k for k in self.config.api_keys}
        default = self.config.default_service_class
        if keys:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme != "Bearer" or token not in keys:
                raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')")
            default = keys[token].service_class or default
        return request.headers.get("x-service-class") or default


# What a model card passes on from a back end's: what the model is for and what it takes (the chat page offers
# images only to a model with vision).
CARD_FIELDS = ("task", "capabilities", "max_model_len")
# The routes forwarded to back ends: OpenAI's under /v1/, and vLLM's rerank and score without the prefix.
FORWARDED_PREFIXES = ("/v1/", "/rerank", "/score")


class DrainGate:
    """Counts each forwarded request in flight until its last byte is sent (a relayed stream too), and refuses new
    ones with 503 while draining. Plain ASGI, as the server's Gate is, so a stream counts until it ends."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(FORWARDED_PREFIXES):
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            await APIError(503, "the gateway is shutting down").response()(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


def build_app(gateway: Gateway) -> FastAPI:
    metrics = GatewayMetrics(lambda: gateway.router)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(limits=limits) as client:
            app.state.proxy = Proxy(client, metrics)
            state.at_drain_timeout.append(app.state.proxy.cut_off_streams)
            await check_all(list(gateway.router.backends.values()), client)
            checker = asyncio.create_task(_check_forever(gateway, client))
            loop = asyncio.get_running_loop()
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
                loop.add_signal_handler(signal.SIGHUP, gateway.reload)
            yield
            checker.cancel()

    app = FastAPI(title="heteroserve gateway", lifespan=lifespan)
    state = ServerState()  # its draining flag and in-flight count; readiness is the back ends'
    app.state.server = state
    app.add_middleware(DrainGate, state=state)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        response = exc.response()
        response.headers["X-Request-Id"] = request_id(request)
        return response

    _add_page_and_probe_routes(app, gateway, state, metrics)
    _add_api_routes(app, gateway)
    return app


def request_id(request: Request) -> str:
    """The client's X-Request-Id, or a new one; the same for every use within a request."""
    if not hasattr(request.state, "request_id"):
        request.state.request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    return request.state.request_id


def _add_page_and_probe_routes(app: FastAPI, gateway: Gateway, state: ServerState, metrics: GatewayMetrics) -> None:
    add_chat_page_routes(app)

    def backend_states() -> dict[str, str]:
        return {b.name: "up" if b.up else "down" for b in gateway.router.backends.values()}

    @app.get("/health")
    async def health():
        return {"status": "ok", "backends": backend_states()}

    @app.get("/health/ready")
    async def ready():
        states = backend_states()
        if state.draining:
            return JSONResponse({"status": "draining", "backends": states}, status_code=503)
        if "up" not in states.values():
            return JSONResponse({"status": "no healthy back end", "backends": states}, status_code=503)
        return {"status": "ready", "backends": states}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _model_cards(gateway: Gateway, service_class: str | None) -> list[dict]:
    """A card per routed name, with what its back ends' cards say the model is for and takes (CARD_FIELDS)."""
    created = int(time.time())
    cards = []
    for name in gateway.router.model_names():
        card = {"id": name, "object": "model", "created": created, "owned_by": "heteroserve"}
        target = gateway.router.resolve(name, service_class)
        known = [b.cards[target.model] for b in target.backends if target.model in b.cards] if target else []
        card.update({k: known[0][k] for k in CARD_FIELDS if known and k in known[0]})
        cards.append(card)
    return cards


def _route(gateway: Gateway, content: bytes, service_class: str | None) -> tuple[Target, bytes]:
    """The back ends for a request body's model, and the body to send them (an alias renamed to the route's
    model); 400 for a body without a model name, 404 for an unknown model."""
    try:
        body = json.loads(content)
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str):
        raise APIError(400, "model: a model name is required", "model")
    target = gateway.router.resolve(model, service_class)
    if target is None:
        raise APIError(404, f"the model {model!r} does not exist", "model")
    if target.model != model:  # an alias: the back ends know the route's name
        content = json.dumps({**body, "model": target.model}).encode()
    return target, content


def _add_api_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.get("/v1/models")
    async def models(request: Request):
        cards = _model_cards(gateway, gateway.service_class(request))
        return JSONResponse({"object": "list", "data": cards}, headers={"X-Request-Id": request_id(request)})

    @app.post("/v1/{path:path}")
    async def forward(path: str, request: Request):
        """Any /v1/* POST, to a back end serving the body's model (its task is the back end's business)."""
        rid = request_id(request)
        target, content = _route(gateway, await request.body(), gateway.service_class(request))
        response = await request.app.state.proxy.forward(gateway.config, path, content, target, rid)
        response.headers["X-Request-Id"] = rid
        return response

    @app.post("/rerank")
    async def rerank(request: Request):
        """vLLM's unprefixed route, sent to the back end's /v1/rerank (vLLM serves both)."""
        return await forward("rerank", request)

    @app.post("/score")
    async def score(request: Request):
        """vLLM's unprefixed route, sent to the back end's /v1/score (vLLM serves both)."""
        return await forward("score", request)


async def _check_forever(gateway: Gateway, client: httpx.AsyncClient) -> None:
    while True:
        await asyncio.sleep(gateway.config.health.interval)
        await check_all(list(gateway.router.backends.values()), client)


def run_gateway(args: argparse.Namespace) -> None:
    """Serves the gateway of `args.config` until SIGTERM, which drains it as the server drains."""
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
    DrainingServer(config, app.state.server, args.drain_timeout).run()
