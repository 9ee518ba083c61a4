"""The server's front door: API key, draining and engine-health checks, in-flight accounting, disconnects.

A plain ASGI middleware rather than Starlette's BaseHTTPMiddleware: that one pipes every streamed body through
an extra task and returns before the stream ends, so it both slows the first token and would count a stream
as finished while it still runs (the SIGTERM drain waits on this count).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from heteroserve.engine.async_engine import AsyncLLMEngine
from heteroserve.entrypoints.openai.errors import APIError

KEYED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that hung up before the answer

T = TypeVar("T")


class ServerState:
    """Readiness and in-flight accounting, shared by the routes and the SIGTERM drain."""

    def __init__(self) -> None:
        self.ready = False
        self.draining = False
        self.in_flight = 0


class Gate:
    """Guards /v1/*, /tokenize and /detokenize; probes, /metrics and the chat page pass freely."""

    def __init__(self, app: ASGIApp, engine: AsyncLLMEngine, state: ServerState, api_key: str | None) -> None:
        self.app, self.engine, self.state, self.api_key = app, engine, state, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(KEYED_PREFIXES):
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)  # returns once the whole body, streamed or not, is sent
        finally:
            self.state.in_flight -= 1

    def _refusal(self, scope: Scope) -> APIError | None:
        if self.api_key is not None:
            headers = dict(scope["headers"])
            if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {self.api_key}":
                return APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')")
        if self.state.draining:
            return APIError(503, "the server is shutting down")
        if not self.engine.is_alive:
            return APIError(500, f"the engine has failed: {self.engine.dead_error!r}")
        return None


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """Runs `work` (a request handler) but cancels it if the client goes away first, which aborts its engine
    request and frees its KV blocks. A stream that has started is watched by its StreamingResponse instead."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody is left to read it
    return task.result()


async def _disconnected(request: Request) -> None:
    """The body has been read, so the next message the server sends is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
