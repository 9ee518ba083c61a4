"""Two sides of `heteroserve bench serve` measured in pairs (the server against the offline engine, or through
the gateway against directly), alternating which goes first, so that this machine's drifts from one minute to the
next fall on both sides of every pair."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Awaitable, Callable

import httpx

from heteroserve.bench.engine_runs import Requests, run_batch, time_to_first_token
from heteroserve.bench.serve import run_clients, stream_request, summarize
from heteroserve.engine.llm_engine import LLMEngine

TTFT_OUTPUT_LEN = 8
# A pause before each measured request: OpenMP workers spin for a few ms after a process's last parallel region,
# and that spinning would otherwise steal a core from the start of the other side's prefill.
SETTLE_S = 0.05

Throughput = Callable[[Requests], float]  # requests -> output tokens/s


def alternate_throughput(
    first_round: tuple[float, float], first: Throughput, second: Throughput, later_rounds: list[Requests]
) -> list[tuple[float, float]]:
    """Both sides' output tokens/s over rounds: the first round's pair as already measured, then each later round
    on requests of its own (so neither side finds them in its prefix cache), the side that goes first alternating."""
    rounds = [first_round]
    for index, requests in enumerate(later_rounds, start=1):
        if index % 2:
            second_s = second(requests)
            rounds.append((first(requests), second_s))
        else:
            first_s = first(requests)
            rounds.append((first_s, second(requests)))
    return rounds


def served_throughput(url: str, args, model: str | None) -> Throughput:
    def throughput(requests: Requests) -> float:
        wall, timings = asyncio.run(
            run_clients(url, requests, args.concurrency, args.request_rate, model, args.api_key, args.seed)
        )
        summary = summarize(wall, timings)
        if summary["errors"]:
            raise SystemExit(f"a request to {url} failed: {summary['errors'][0]}")
        return summary["output_tokens_per_s"]

    return throughput


def offline_throughput(engine: LLMEngine) -> Throughput:
    def throughput(requests: Requests) -> float:
        batch = run_batch(engine, requests)
        return batch.output_tokens / batch.wall_s

    return throughput


def pooled_rounds(rounds: list[tuple[float, float]], names: tuple[str, str], ratios: list[float]) -> dict[str, object]:
    """Each round's output tokens/s of both sides and its ratio, and the median of those ratios."""
    return {
        "rounds": len(rounds),
        f"rounds_{names[0]}_output_tokens_per_s": [a for a, _ in rounds],
        f"rounds_{names[1]}_output_tokens_per_s": [b for _, b in rounds],
        "rounds_ratio": ratios,
        "ratio": statistics.median(ratios),
    }


TtftOf = Callable[[int, list[int]], Awaitable[float]]  # (index, prompt) -> seconds to the first token


async def alternate_ttft(prompts: list[list[int]], first: TtftOf, second: TtftOf) -> tuple[list[float], list[float]]:
    """Each prompt once on each side, alternating which goes first and pausing before each, so slow drifts of
    the machine (they move a prefill's time between runs as much as the differences measured) fall on both sides
    of every pair."""
    times: tuple[list[float], list[float]] = ([], [])
    sides = ((first, times[0]), (second, times[1]))
    for i, prompt in enumerate(prompts):
        for ttft_of, found in sides if i % 2 == 0 else sides[::-1]:
            await asyncio.sleep(SETTLE_S)
            found.append(await ttft_of(i, prompt))
    return times


def served_ttft(client: httpx.AsyncClient, url: str, model: str | None, api_key: str | None) -> TtftOf:
    async def ttft_of(_: int, prompt: list[int]) -> float:
        timing = await stream_request(client, url, model, prompt, TTFT_OUTPUT_LEN, api_key)
        if timing.error is not None:
            raise SystemExit(f"a request to {url} failed: {timing.error}")
        return timing.ttft_s

    return ttft_of


async def paired_ttft(
    url: str, model: str | None, api_key: str | None, engine: LLMEngine, prompts: list[list[int]]
) -> dict[str, list[float]]:
    """Each prompt through the server and offline (see `alternate_ttft`)."""

    async def offline(i: int, prompt: list[int]) -> float:
        return time_to_first_token(engine, f"ttft-{i}", prompt, TTFT_OUTPUT_LEN)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await stream_request(client, url, model, prompts[0], 1, api_key)  # opens the kept-alive connection
        server_s, offline_s = await alternate_ttft(prompts, served_ttft(client, url, model, api_key), offline)
    return {"server_ttft_s": server_s, "offline_ttft_s": offline_s}


async def paired_gateway_ttft(
    direct: str, gateway: str, model: str | None, api_key: str | None, prompts: list[list[int]]
) -> dict[str, object]:
    """Each prompt straight to the server and through the gateway (see `alternate_ttft`; prefix caching is off in
    this mode)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for url in (direct, gateway):  # opens both kept-alive connections
            await stream_request(client, url, model, prompts[0], 1, api_key)
        direct_s, gateway_s = await alternate_ttft(
            prompts, served_ttft(client, direct, model, api_key), served_ttft(client, gateway, model, api_key)
        )
    differences_ms = [1000 * (g - d) for g, d in zip(gateway_s, direct_s, strict=True)]
    return {
        "pairs": len(prompts),
        "overhead_p50_ms": statistics.median(differences_ms),
        "overhead_samples_ms": differences_ms,
    }


def pooled_pairs(rounds: list[dict[str, list[float]]]) -> dict[str, object]:
    """The median over every pair of every round, and each round's own median difference."""
    server_s = [t for r in rounds for t in r["server_ttft_s"]]
    offline_s = [t for r in rounds for t in r["offline_ttft_s"]]
    differences_ms = [1000 * (s - o) for s, o in zip(server_s, offline_s, strict=True)]
    per_round = [
        statistics.median(1000 * (s - o) for s, o in zip(r["server_ttft_s"], r["offline_ttft_s"], strict=True))
        for r in rounds
    ]
    return {
        "pairs": len(differences_ms),
        "rounds": len(rounds),
        "server_ttft_p50_ms": 1000 * statistics.median(server_s),
        "offline_ttft_p50_ms": 1000 * statistics.median(offline_s),
        "overhead_p50_ms": statistics.median(differences_ms),
        "overhead_p50_ms_per_round": per_round,
        "overhead_samples_ms": differences_ms,
    }
