"""The server's front door: API key, draining and engine-health checks, body size, in-flight accounting,
disconnects.

A plain ASGI middleware rather than Starlette's BaseHTTPMiddleware: that one pipes every streamed body through
an extra task and returns before the stream ends, so it both slows the first token and would count a stream
as finished while it still runs (the SIGTERM drain waits on this count).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from fastapi import Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from heteroserve.entrypoints.openai.errors import APIError

if TYPE_CHECKING:  # the gateway shares ServerState and runs no engine: it must not load torch
    from heteroserve.engine.async_engine import AsyncLLMEngine

KEYED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/rerank", "/score")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that hung up before the answer

T = TypeVar("T")


class ServerState:
    """Readiness and in-flight accounting, shared by the routes and the SIGTERM drain."""

    def __init__(self) -> None:
        self.ready = False
        self.draining = False
        self.in_flight = 0
        # Called when the drain timeout passes with requests in flight, so that streams can end with an error
        # event before the connections close.
        self.at_drain_timeout: list[Callable[[], None]] = []


class Gate:
    """Guards /v1/*, /tokenize, /detokenize, /rerank and /score; probes, /metrics and the chat page pass freely."""

    def __init__(
        self, app: ASGIApp, engine: AsyncLLMEngine, state: ServerState, api_key: str | None, max_body_bytes: int
    ) -> None:
        self.app, self.engine, self.state, self.max_body_bytes = app, engine, state, max_body_bytes
        self.expected_authorization = None if api_key is None else f"Bearer {api_key}".encode()

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
            body = await self._read_body(scope, receive)
            if isinstance(body, APIError):
                await body.response()(scope, receive, send)
                return
            # Returns once the whole answer, streamed or not, is sent.
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.state.in_flight -= 1

    def _refusal(self, scope: Scope) -> APIError | None:
        if self.expected_authorization is not None:
            sent = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(sent, self.expected_authorization):  # in constant time: no key by timing
                return APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')")
        if self.state.draining:
            return APIError(503, "the server is shutting down")
        if not self.engine.is_alive:
            return APIError(500, f"the engine has failed: {self.engine.dead_error!r}")
        return None

    async def _read_body(self, scope: Scope, receive: Receive) -> Message | APIError:
        """The whole request body as one message, or a 413 past --max-request-body-bytes: at once when
        Content-Length says so, else as soon as the count of what arrived passes it (a chunked body has no length).
        Read here, before any handler runs, so that no handler parses or tokenizes an oversized body."""
        limit = self.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return APIError(
                413,
                f"the request body is {int(declared)} bytes; this server accepts at most {limit} "
                "(--max-request-body-bytes)",
            )
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message  # the client left; the handler sees it
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return APIError(
                    413,
                    f"the request body passed {limit} bytes, the most this server accepts (--max-request-body-bytes)",
                )
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}


def _replay(first: Message, receive: Receive) -> Receive:
    """A receive that hands out `first` (the body already read), then the connection's own messages."""
    pending = [first]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


async def unless_disconnected(
    request: Request, work: Awaitable[T], on_disconnect: Callable[[], None] | None = None
) -> T | Response:
    """Runs `work` (a request handler) but cancels it if the client goes away first, which aborts its engine
    request and frees its KV blocks; `on_disconnect` is then called (the abort metric). A stream that has started
    is watched by its StreamingResponse instead."""
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
        if on_disconnect is not None:
            on_disconnect()
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody is left to read it
    return task.result()


async def _disconnected(request: Request) -> None:
    """The body has been read, so the next message the server sends is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
