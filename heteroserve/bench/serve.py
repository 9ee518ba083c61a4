"""`heteroserve bench serve`: streaming clients against any OpenAI-compatible server (scenario C)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestTiming:
    ttft_s: float | None = None
    inter_token_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    output_tokens: int = 0
    error: str | None = None


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    ordered = sorted(values)
    pick = lambda q: scale * ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": scale * statistics.fmean(ordered)}


async def stream_request(
    client: httpx.AsyncClient, url: str, model: str | None, prompt: list[int], max_tokens: int, api_key: str | None
) -> RequestTiming:
    timing = RequestTiming()
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return timing
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    timing.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if timing.ttft_s is None:
                        timing.ttft_s = now - start
                    else:
                        timing.inter_token_s.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    timing.e2e_s = time.perf_counter() - start
    return timing


async def run_clients(
    url: str,
    requests: list[tuple[list[int], int]],
    concurrency: int,
    request_rate: float | None,
    model: str | None,
    api_key: str | None,
    seed: int = 0,
) -> tuple[float, list[RequestTiming]]:
    """`concurrency` clients share the requests; with `request_rate`, arrivals are Poisson at that rate."""
    limit = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=concurrency)
    ) as client:

        async def guarded(prompt, max_tokens, delay):
            await asyncio.sleep(delay)
            async with limit:
                return await stream_request(client, url, model, prompt, max_tokens, api_key)

        delays, t = [], 0.0
        for _ in requests:
            delays.append(t)
            if request_rate:
                t += rng.expovariate(request_rate)
        start = time.perf_counter()
        timings = await asyncio.gather(*(guarded(p, g, d) for (p, g), d in zip(requests, delays, strict=True)))
        return time.perf_counter() - start, list(timings)


def summarize(wall_s: float, timings: list[RequestTiming]) -> dict[str, object]:
    ok = [t for t in timings if t.error is None]
    tokens = sum(t.output_tokens for t in ok)
    return {
        "wall_s": wall_s,
        "requests": len(timings),
        "errors": [t.error for t in timings if t.error is not None],
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall_s if wall_s else 0.0,
        "ttft_ms": percentiles([t.ttft_s for t in ok if t.ttft_s is not None]),
        "inter_token_ms": percentiles([x for t in ok for x in t.inter_token_s]),
        "e2e_ms": percentiles([t.e2e_s for t in ok]),
    }


class OwnServer:
    """Starts `heteroserve serve` (or, with `command`, another heteroserve command that serves HTTP, or with
    `python` too, a peer's server) on a free local port, for a self-contained run, in this process's environment,
    without forcing OMP_WAIT_POLICY=PASSIVE, under which OpenMP workers wake up for every operator and a prefill pays
    for it (bench/README.md, "Figures behind the code's choices")."""

    def __init__(
        self,
        model: str | None,
        flags: list[str],
        startup_timeout: float = 300,
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
        port: int | None = None,
        python: str = sys.executable,
        ready_path: str = "/health/ready",
    ) -> None:
        """`env`: variables added to this process's; `port`: a given one (a restart) rather than a free one;
        `python`: the interpreter running `command` (another virtualenv's for a peer's server); `ready_path`: what
        answers 200 once the model is loaded."""
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        command = command or ["heteroserve.entrypoints.openai.api_server", "--uvicorn-log-level", "warning"]
        argv = [python, "-m", *command, "--host", "127.0.0.1", "--port", str(self.port), *flags]
        if model:
            argv += ["--model", model]
        self.process = subprocess.Popen(
            argv,
            env={**os.environ, **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{' '.join(command)} exited with code {self.process.returncode}")
            try:
                if httpx.get(f"{self.url}{ready_path}", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{' '.join(command)} did not become ready")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def start_gateway(backend_url: str, model: str, folder: str) -> OwnServer:
    """A `heteroserve gateway` with one back end, to measure what the gateway adds."""
    config = os.path.join(folder, "gateway.yaml")
    with open(config, "w") as f:
        f.write(f"backends:\n  - name: direct\n    url: {backend_url}\n    models: [{json.dumps(model)}]\n")
    return OwnServer(
        None, ["--config", config, "--uvicorn-log-level", "warning"], command=["heteroserve.entrypoints.cli", "gateway"]
    )
