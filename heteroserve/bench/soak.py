"""`heteroserve bench soak`: the gateway in front of two or more servers under mixed traffic for a bounded time,
with faults injected on a schedule; what it reports is what was lost.

Traffic (through the gateway, as the chat page and API clients send it): streamed and whole chats, completions
with n > 1, streamed completions, clients that hang up mid-stream, and bad requests that must answer 4xx.
Faults, at fixed fractions of the run: a back end SIGKILLed (and started again), a back end SIGSTOPped for longer
than the gateway's health timeout (then SIGCONT), a SIGHUP config reload of the gateway, and a SIGTERM drain of a
back end (started again after it exits).

Targets: no good request fails before its first byte (the gateway retries on another back end), every stream
that breaks ends with an error event, no 5xx outside the windows in which a back end was killed or stopped, no
KV block in use once the load is over, the drained back end exits 0 in time, and each server's RSS grows by less
than 5% after warm-up. `failures` lists what missed its target; any makes the command exit 1.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from heteroserve.bench.machine import describe_machine
from heteroserve.bench.serve import OwnServer
from heteroserve.platforms import resolve_platform

MODEL = "SmolLM2-135M-Instruct"
DRAIN_TIMEOUT_S = 20
# A drained server must have exited by then: its drain, uvicorn's graceful shutdown (5 s) and the engine's.
EXIT_AFTER_DRAIN_S = DRAIN_TIMEOUT_S + 10
SERVER_FLAGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(64 * 1024**2)]
SERVER_FLAGS += ["--drain-timeout", str(DRAIN_TIMEOUT_S)]
# Each server gets one thread: they and the gateway share the machine's cores, and spinning OpenMP workers of
# several processes on the same cores slow each other many times over.
SERVER_ENV = {"HETEROSERVE_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
HEALTH = {"interval": 0.5, "timeout": 1.0, "failure_threshold": 2, "cooldown": 1.0}
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a KV cache is in one sentence.",
]


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    rejected_as_expected: int = 0  # bad requests that got their 4xx
    cancelled_by_client: int = 0
    failed_before_first_byte: int = 0  # a good request answered non-2xx or not at all, before any byte
    failed_during_faults: int = 0  # the same, inside a fault window (a back end killed or stopped)
    streams_broken_with_error_event: int = 0
    streams_broken_without_error_event: int = 0
    unexpected_5xx: int = 0  # 5xx outside every fault window
    unexpected_status: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)


@dataclass
class FaultWindows:
    """When a back end was down or stopped (start, end), with a grace period for the gateway to notice."""

    spans: list[tuple[float, float]] = field(default_factory=list)
    grace_s: float = 3.0

    def covers(self, start: float, end: float) -> bool:
        return any(start <= b + self.grace_s and end >= a for a, b in self.spans)


class SoakServer:
    """One `heteroserve serve` that the soak can kill, stop, drain and start again on the same port."""

    def __init__(self, name: str, model: str | None) -> None:
        self.name = name
        self.model = model
        self.own = OwnServer(model, SERVER_FLAGS, env=SERVER_ENV)
        self.url = self.own.url
        self.rss_after_warmup_kib: int | None = None
        self.restarts = 0

    @property
    def pid(self) -> int:
        return self.own.process.pid

    def restart(self) -> None:
        self.own = OwnServer(self.model, SERVER_FLAGS, env=SERVER_ENV, port=self.own.port)
        self.restarts += 1
        self.rss_after_warmup_kib = None

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0


def gateway_config(servers: list[SoakServer], weight_of_first: int = 1) -> dict:
    backends = [
        {"name": s.name, "url": s.url, "models": [MODEL], "weight": weight_of_first if i == 0 else 1}
        for i, s in enumerate(servers)
    ]
    return {"backends": backends, "health": HEALTH, "max_attempts": 3, "connect_timeout": 2, "read_timeout": 120}


async def one_request(client: httpx.AsyncClient, url: str, kind: str, rng: random.Random, tally: Tally, faults):
    question = rng.choice(QUESTIONS)
    max_tokens = rng.randint(8, 48)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens}
    completion = {"model": MODEL, "prompt": question, "max_tokens": max_tokens}
    path, body, stream = {
        "chat_stream": ("/v1/chat/completions", {**chat, "stream": True}, True),
        "chat": ("/v1/chat/completions", {**chat, "temperature": 0}, False),
        "completion_n2": (
            "/v1/completions",
            {**completion, "n": 2, "temperature": 0.8, "seed": rng.randint(0, 99)},
            False,
        ),
        "completion_stream": ("/v1/completions", {**completion, "stream": True}, True),
        "cancelled": ("/v1/chat/completions", {**chat, "max_tokens": 200, "stream": True}, True),
        "bad": (
            "/v1/chat/completions",
            rng.choice([{"messages": []}, {**chat, "max_tokens": "x"}, {**chat, "n": 0}]),
            False,
        ),
    }[kind]
    tally.sent += 1
    start = time.monotonic()
    got_bytes = False
    try:
        async with client.stream("POST", url + path, json=body) as response:
            if kind == "bad":
                await response.aread()
                if 400 <= response.status_code < 500:
                    tally.rejected_as_expected += 1
                else:
                    tally.unexpected_status.append(f"bad request answered {response.status_code}")
                return
            if response.status_code != 200:
                await response.aread()
                raise httpx.HTTPStatusError(str(response.status_code), request=response.request, response=response)
            if not stream:
                json.loads(await response.aread())
                got_bytes = True
                tally.answered += 1
                tally.latencies_s.append(time.monotonic() - start)
                return
            done = errored = False
            chunks = 0
            async for line in response.aiter_lines():
                got_bytes = True
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    done = True
                    break
                if '"error"' in payload and "error" in json.loads(payload):
                    errored = True
                chunks += 1
                if kind == "cancelled" and chunks >= 3:
                    tally.cancelled_by_client += 1
                    return  # leaving the block closes the connection: the server must abort and free the request
            if done and not errored:
                tally.answered += 1
                tally.latencies_s.append(time.monotonic() - start)
            elif errored:
                tally.streams_broken_with_error_event += 1
            else:
                tally.streams_broken_without_error_event += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        status = exc.response.status_code if isinstance(exc, httpx.HTTPStatusError) else None
        in_fault = faults.covers(start, time.monotonic())
        if got_bytes:
            tally.streams_broken_without_error_event += 1
        elif in_fault:
            tally.failed_during_faults += 1
        else:
            tally.failed_before_first_byte += 1
        if status is not None and status >= 500 and not in_fault:
            tally.unexpected_5xx += 1
        if status is not None and status < 500:
            tally.unexpected_status.append(f"{kind} answered {status}")


async def traffic(url: str, deadline: float, concurrency: int, tally: Tally, faults: FaultWindows, seed: int):
    kinds = ["chat_stream"] * 4 + ["chat"] * 2 + ["completion_n2", "completion_stream", "cancelled", "bad"]
    limits = httpx.Timeout(120, connect=5)

    async def worker(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        async with httpx.AsyncClient(timeout=limits) as client:
            while time.monotonic() < deadline:
                await one_request(client, url, rng.choice(kinds), rng, tally, faults)

    await asyncio.gather(*(worker(i) for i in range(concurrency)))


def wait_exit(process: subprocess.Popen, timeout: float) -> int | None:
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def drain(process: subprocess.Popen, name: str, exit_within_s: float) -> dict:
    """SIGTERM, then the event that says how the back end ended: "exited" with its code, or "did not exit after
    drain" when it was still running `exit_within_s` later (it is then SIGKILLed, so that it can be restarted)."""
    process.send_signal(signal.SIGTERM)
    code = wait_exit(process, exit_within_s)
    if code is None:
        process.kill()
        process.wait()
        return {"event": "did not exit after drain", "backend": name, "waited_s": exit_within_s}
    return {"event": "exited", "backend": name, "code": code}


async def inject_faults(
    servers: list[SoakServer],
    gateway: OwnServer,
    config_path: Path,
    start: float,
    duration: float,
    faults: FaultWindows,
    log: list[dict],
) -> None:
    """The schedule, at fractions of the run: kill and restart servers[0]; stop and continue servers[1]; reload the
    gateway; drain servers[0] with SIGTERM and start it again. Each event is logged with its time."""

    async def at(fraction: float) -> None:
        await asyncio.sleep(max(0.0, start + fraction * duration - time.monotonic()))

    def note(event: str, **extra) -> None:
        log.append({"t_s": round(time.monotonic() - start, 2), "event": event, **extra})

    victim, stopped = servers[0], servers[1]
    await at(0.10)
    for server in servers:
        server.rss_after_warmup_kib = server.rss_kib()
    await at(0.15)
    down = time.monotonic()
    victim.own.process.kill()
    note("SIGKILL", backend=victim.name)
    await asyncio.to_thread(wait_exit, victim.own.process, 10)
    await at(0.25)
    await asyncio.to_thread(victim.restart)
    faults.spans.append((down, time.monotonic()))
    note("restarted", backend=victim.name)
    await at(0.40)
    paused = time.monotonic()
    os.kill(stopped.pid, signal.SIGSTOP)
    note("SIGSTOP", backend=stopped.name)
    await asyncio.sleep(HEALTH["timeout"] * 3 + HEALTH["interval"] * HEALTH["failure_threshold"])
    os.kill(stopped.pid, signal.SIGCONT)
    faults.spans.append((paused, time.monotonic()))
    note("SIGCONT", backend=stopped.name)
    await at(0.60)
    config_path.write_text(yaml.safe_dump(gateway_config(servers, weight_of_first=2)))
    os.kill(gateway.process.pid, signal.SIGHUP)
    note("SIGHUP", target="gateway")
    await at(0.80)
    draining = time.monotonic()
    note("SIGTERM", backend=victim.name)
    ended = await asyncio.to_thread(drain, victim.own.process, victim.name, EXIT_AFTER_DRAIN_S)
    note(**ended)
    await asyncio.to_thread(victim.restart)
    faults.spans.append((draining, time.monotonic()))
    note("restarted", backend=victim.name)


def server_state(server: SoakServer) -> dict[str, float]:
    wanted = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    state = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        for name in wanted:
            if line.startswith(f"heteroserve:{name}"):
                state[name] = float(line.rsplit(" ", 1)[1])
    return state


def gateway_retries(gateway: OwnServer) -> float:
    total = 0.0
    for line in httpx.get(f"{gateway.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("heteroserve:gateway_retries_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def settle(servers: list[SoakServer], timeout: float = 30) -> list[dict[str, float]]:
    """Each server's load gauges once nothing is running any more (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        states = [server_state(s) for s in servers]
        idle = all(s.get("num_requests_running", 1) == 0 and s.get("num_requests_waiting", 1) == 0 for s in states)
        if idle or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


def run_soak(args) -> dict:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the report
    folder = Path(tempfile.mkdtemp(prefix="heteroserve-soak-"))
    servers = [SoakServer(f"server-{i}", args.model) for i in range(args.servers)]
    config_path = folder / "gateway.yaml"
    config_path.write_text(yaml.safe_dump(gateway_config(servers)))
    gateway = OwnServer(
        None,
        ["--config", str(config_path), "--uvicorn-log-level", "warning"],
        command=["heteroserve.entrypoints.cli", "gateway"],
    )
    tally, faults, events = Tally(), FaultWindows(), []
    try:
        start = time.monotonic()

        async def main() -> None:
            deadline = start + args.duration
            await asyncio.gather(
                traffic(gateway.url, deadline, args.concurrency, tally, faults, args.seed),
                inject_faults(servers, gateway, config_path, start, args.duration, faults, events),
            )

        asyncio.run(main())
        wall = time.monotonic() - start
        states = settle(servers)
        retries = gateway_retries(gateway)
        rss = {
            s.name: {
                "after_warmup_kib": s.rss_after_warmup_kib,
                "end_kib": s.rss_kib(),
                "growth": (s.rss_kib() / s.rss_after_warmup_kib - 1) if s.rss_after_warmup_kib else None,
                "restarts": s.restarts,
            }
            for s in servers
        }
    finally:
        gateway.stop()
        for server in servers:
            server.own.stop()
    latencies = sorted(tally.latencies_s)
    result = {
        "command": "soak",
        "duration_s": args.duration,
        "wall_s": wall,
        "servers": args.servers,
        "concurrency": args.concurrency,
        "requests": {
            "sent": tally.sent,
            "answered": tally.answered,
            "rejected_as_expected": tally.rejected_as_expected,
            "cancelled_by_client": tally.cancelled_by_client,
            "retried_by_gateway": retries,
            "failed_before_first_byte": tally.failed_before_first_byte,
            "failed_during_faults": tally.failed_during_faults,
            "streams_broken_with_error_event": tally.streams_broken_with_error_event,
            "streams_broken_without_error_event": tally.streams_broken_without_error_event,
            "unexpected_5xx": tally.unexpected_5xx,
            "unexpected_status": tally.unexpected_status[:20],
        },
        "latency_s": {
            "p50": statistics.median(latencies) if latencies else None,
            "p99": latencies[int(0.99 * (len(latencies) - 1))] if latencies else None,
        },
        "kv_cache_usage_after_load": {
            s.name: state.get("kv_cache_usage_perc") for s, state in zip(servers, states, strict=True)
        },
        "requests_running_after_load": {
            s.name: state.get("num_requests_running", 0) + state.get("num_requests_waiting", 0)
            for s, state in zip(servers, states, strict=True)
        },
        "rss": rss,
        "faults": events,
        "machine": describe_machine(resolve_platform("auto")),
    }
    return result


def run_soak_command(args) -> None:
    if args.servers < 2:
        raise SystemExit("--servers must be at least 2: the faults take one back end away at a time")
    if args.duration < 20:
        raise SystemExit("--duration must be at least 20 s: the fault schedule needs the room")
    result = run_soak(args)
    result["failures"] = soak_failures(result)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(text + "\n")
    sys.exit(1 if result["failures"] else 0)


def soak_failures(result: dict) -> list[str]:
    """What the soak's targets say went wrong, one line each (none: it passed)."""
    lost = result["requests"]
    failures = [
        f"{lost[name]} {name.replace('_', ' ')}"
        for name in ("failed_before_first_byte", "streams_broken_without_error_event", "unexpected_5xx")
        if lost[name]
    ]
    failures += [
        f"KV cache in use after the load on {name}" for name, v in result["kv_cache_usage_after_load"].items() if v
    ]
    for event in result["faults"]:
        if event["event"] == "did not exit after drain":
            failures.append(f"{event['backend']} did not exit within {event['waited_s']} s of SIGTERM (drain)")
        elif event["event"] == "exited" and event["code"] != 0:
            failures.append(f"{event['backend']} exited with code {event['code']} after SIGTERM (drain)")
    return failures
