"""Forwarding one request: retried on another back end while nothing has reached the client, then relayed
chunk by chunk. A stream that breaks after that, or that the SIGTERM drain's timeout cuts off, ends with an SSE
error event and [DONE], so the client can tell a broken answer from a finished one."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import anyio
import httpx
from fastapi.responses import Response, StreamingResponse

from heteroserve.entrypoints.gateway.backends import Backend
from heteroserve.entrypoints.gateway.config import GatewayConfig
from heteroserve.entrypoints.gateway.metrics import GatewayMetrics
from heteroserve.entrypoints.gateway.router import Router, Target
from heteroserve.entrypoints.openai.errors import RETRY_AFTER_S, APIError

_EVENT_END = b"\n\n"


class _DrainTimedOut(Exception):
    """The drain timeout passed while a relayed stream was still open."""


class Proxy:
    def __init__(self, client: httpx.AsyncClient, metrics: GatewayMetrics) -> None:
        self.client, self.metrics = client, metrics
        self.cut_off = False
        self.reads: set[anyio.CancelScope] = set()  # the relayed streams' reads under way

    def cut_off_streams(self) -> None:
        """The drain timeout passed: every relayed stream ends with an error event, now if it is waiting for the
        back end, else at its next read."""
        self.cut_off = True
        for read in self.reads:
            read.cancel()

    async def forward(
        self, config: GatewayConfig, path: str, content: bytes, target: Target, request_id: str
    ) -> Response:
        """Tries up to `max_attempts` healthy back ends of the target; a connection error or a 5xx answer
        moves on to the next. The last 5xx answer is returned as it came when every attempt failed."""
        tried: set[str] = set()
        previous: Backend | None = None
        failure: Response | None = None
        timeout = httpx.Timeout(config.read_timeout, connect=config.connect_timeout)
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        for _ in range(config.max_attempts):
            backend = Router.pick(target, tried)
            if backend is None:
                break
            if previous is not None:
                self.metrics.retries.labels(previous.name).inc()
            previous = backend
            tried.add(backend.name)
            self.metrics.requests.labels(backend.name).inc()
            url = f"{backend.config.url.rstrip('/')}/v1/{path}"
            request = self.client.build_request(
                "POST", url, content=content, headers={**headers, **backend.headers()}, timeout=timeout
            )
            backend.outstanding += 1
            response: httpx.Response | None = None
            relayed = False
            start = time.monotonic()
            try:
                response = await self.client.send(request, stream=True)
                if response.status_code >= 500:
                    body = await response.aread()
                    backend.record_5xx()
                    self.metrics.errors.labels(backend.name, "status").inc()
                    failure = _answer(body, response, backend)
                    continue
                self.metrics.latency.labels(backend.name).observe(time.monotonic() - start)
                backend.record_success()
                if response.headers.get("content-type", "").startswith("text/event-stream"):
                    relayed = True
                    return _RelayResponse(self._relay(response, backend), _Release(response, backend), response)
                body = await response.aread()  # a JSON answer is small: read whole, so a break is retried
                return _answer(body, response, backend)
            except httpx.HTTPError as exc:
                backend.open(f"{type(exc).__name__}: {exc}")
                self.metrics.errors.labels(backend.name, "connect").inc()
                failure = APIError(502, f"back end {backend.name} did not answer: {type(exc).__name__}").response()
            finally:
                if not relayed:
                    backend.outstanding -= 1
                    if response is not None:
                        await response.aclose()
        if failure is None:
            raise APIError(503, f"no healthy back end for model {target.model!r}")
        return failure

    async def _relay(self, response: httpx.Response, backend: Backend) -> AsyncIterator[bytes]:
        """The back end's bytes as they come; the clean-up is `_Release`'s, since a generator that never
        starts (the client left before the first chunk) never runs its own."""
        tail = _EVENT_END
        chunks = response.aiter_raw()
        try:
            while True:
                chunk = await self._next_chunk(chunks)
                tail = (tail + chunk)[-2:]
                yield chunk
        except StopAsyncIteration:
            return
        except _DrainTimedOut:
            error = APIError(503, "the gateway is shutting down: its drain timeout passed before the stream ended")
        except httpx.HTTPError as exc:
            backend.open(f"stream broke: {type(exc).__name__}")
            self.metrics.errors.labels(backend.name, "stream").inc()
            error = APIError(502, f"back end {backend.name} broke off the stream: {type(exc).__name__}")
        ending = b"" if tail == _EVENT_END else _EVENT_END  # close a half-sent event first
        yield ending + f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()

    async def _next_chunk(self, chunks: AsyncIterator[bytes]) -> bytes:
        """The back end's next bytes, read in a cancel scope that cut_off_streams cancels: raises
        _DrainTimedOut once the drain timeout has passed, StopAsyncIteration at the stream's end."""
        if self.cut_off:
            raise _DrainTimedOut
        with anyio.CancelScope() as read:
            self.reads.add(read)
            try:
                return await anext(chunks)
            finally:
                self.reads.discard(read)
        raise _DrainTimedOut  # reached only when the read was cancelled


class _Release:
    """Closes the back end's response and frees its slot, once, whichever way the relay ends."""

    def __init__(self, response: httpx.Response, backend: Backend) -> None:
        self.response, self.backend, self.done = response, backend, False

    async def __call__(self) -> None:
        if not self.done:
            self.done = True
            self.backend.outstanding -= 1
            await self.response.aclose()


class _RelayResponse(StreamingResponse):
    def __init__(self, chunks: AsyncIterator[bytes], release: _Release, upstream: httpx.Response) -> None:
        headers = {"X-Served-By": release.backend.name, "Cache-Control": "no-cache"}
        super().__init__(chunks, status_code=upstream.status_code, media_type="text/event-stream", headers=headers)
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.release()


def _answer(body: bytes, response: httpx.Response, backend: Backend) -> Response:
    headers = {"X-Served-By": backend.name}
    if response.status_code == 429:  # the back end's Retry-After, or ours for one that sends none
        headers["Retry-After"] = response.headers.get("retry-after", str(RETRY_AFTER_S))
    return Response(
        body, status_code=response.status_code, media_type=response.headers.get("content-type"), headers=headers
    )
