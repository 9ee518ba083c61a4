"""`heteroserve bench serve`: scenario C against a server (ours or any OpenAI-compatible one), optionally through
the gateway, and compared with the offline engine on the same requests."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from collections.abc import Awaitable, Callable

import httpx

from heteroserve.bench.engine_runs import run_batch, time_to_first_token
from heteroserve.bench.harness import build_engine, dataset, write_report
from heteroserve.bench.serve import OwnServer, run_clients, start_gateway, stream_request, summarize
from heteroserve.bench.workload import fingerprint
from heteroserve.engine.llm_engine import LLMEngine
from heteroserve.model.loader import load_tokenizer
from heteroserve.model.loader.source import resolve_model
from heteroserve.platforms import resolve_platform

TTFT_OUTPUT_LEN = 8
# A pause before each measured request: OpenMP workers spin for a few ms after a process's last parallel region,
# and that spinning would otherwise steal a core from the start of the other side's prefill.
SETTLE_S = 0.05


def server_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of this bench run, for the server it starts."""
    flags = [
        "--max-model-len",
        str(args.max_model_len),
        "--kernels",
        args.kernels,
        "--dtype",
        args.dtype,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--block-size",
        str(args.block_size),
    ]
    if args.kv_cache_memory_bytes:
        flags += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    if args.max_num_batched_tokens:
        flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.quantization:
        flags += ["--quantization", args.quantization]
    if not args.enable_prefix_caching:
        flags += ["--no-enable-prefix-caching"]
    return flags


TtftOf = Callable[[int, list[int]], Awaitable[float]]  # (index, prompt) -> seconds to the first token


async def alternate(prompts: list[list[int]], first: TtftOf, second: TtftOf) -> tuple[list[float], list[float]]:
    """Each prompt once on each side, alternating which goes first and pausing before each, so slow drifts of
    the machine (they move a 128-token prefill by ~20 ms between runs) fall on both sides of every pair."""
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
    """Each prompt through the server and offline (see `alternate`)."""

    async def offline(i: int, prompt: list[int]) -> float:
        return time_to_first_token(engine, f"ttft-{i}", prompt, TTFT_OUTPUT_LEN)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await stream_request(client, url, model, prompts[0], 1, api_key)  # opens the kept-alive connection
        server_s, offline_s = await alternate(prompts, served_ttft(client, url, model, api_key), offline)
    return {"server_ttft_s": server_s, "offline_ttft_s": offline_s}


async def paired_gateway_ttft(
    direct: str, gateway: str, model: str | None, api_key: str | None, prompts: list[list[int]]
) -> dict[str, object]:
    """Each prompt straight to the server and through the gateway (see `alternate`; prefix caching is off in
    this mode)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for url in (direct, gateway):  # opens both kept-alive connections
            await stream_request(client, url, model, prompts[0], 1, api_key)
        direct_s, gateway_s = await alternate(
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


def run_serve_bench(args: argparse.Namespace) -> None:
    if args.max_model_len is None:
        args.max_model_len = 2048
    if args.gateway:
        if args.base_url is not None:
            raise SystemExit("--gateway measures our own server directly and through a gateway: drop --base-url")
        args.enable_prefix_caching = False  # the same prompts run twice; cache hits would favour the second run
    own = args.base_url is None
    compare = own if args.compare_offline is None else args.compare_offline
    if not 1 <= args.ttft_rounds <= args.ttft_requests:
        raise SystemExit(f"--ttft-rounds must be between 1 and --ttft-requests ({args.ttft_requests})")
    if args.ttft_rounds > 1 and not own:
        raise SystemExit("--ttft-rounds above 1 restarts the server: drop --base-url")
    tokenizer = load_tokenizer(resolve_model(args.model))
    vocab = len(tokenizer) if tokenizer is not None else 0
    # Concurrency-1 requests (and the paired offline comparison) use prompts of their own, so no side finds
    # them in its prefix cache.
    every = dataset(tokenizer, vocab, args, "C", args.num_requests + 2 * args.ttft_requests)
    requests = every[: args.num_requests]
    single = [p for p, _ in every[args.num_requests : args.num_requests + args.ttft_requests]]
    fresh_prompts = [p for p, _ in every[args.num_requests + args.ttft_requests :]]
    server = OwnServer(args.model, server_flags(args)) if own else None
    url = server.url if own else args.base_url.rstrip("/")
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        httpx.get(f"{url}/v1/models", timeout=10, headers=headers).raise_for_status()
    except httpx.HTTPError as exc:
        if server:
            server.stop()
        raise SystemExit(f"cannot reach an OpenAI-compatible server at {url}: {exc}") from exc

    def measure(target: str, model: str | None) -> tuple[dict, list]:
        asyncio.run(run_clients(target, requests[:1], 1, None, model, args.api_key))  # warm-up
        wall, timings = asyncio.run(
            run_clients(target, requests, args.concurrency, args.request_rate, model, args.api_key, args.seed)
        )
        summary = summarize(wall, timings)
        one_at_a_time = [(p, TTFT_OUTPUT_LEN) for p in single]
        ttft_wall, ttft_timings = asyncio.run(run_clients(target, one_at_a_time, 1, None, model, args.api_key))
        summary["concurrency_1"] = summarize(ttft_wall, ttft_timings)
        return summary, timings

    via_gateway = offline = None
    try:
        serving, timings = measure(url, args.served_model)
        if args.gateway:
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            with tempfile.TemporaryDirectory() as folder:
                gateway = start_gateway(url, model, folder)
                try:
                    via_gateway, _ = measure(gateway.url, model)
                    pairs = paired_gateway_ttft(url, gateway.url, model, args.api_key, single)
                    via_gateway["paired_ttft"] = asyncio.run(pairs)
                finally:
                    gateway.stop()
        if compare:  # the server idles meanwhile
            engine = build_engine(args)
            batch = run_batch(engine, requests)
            rounds = []
            size = len(fresh_prompts) // args.ttft_rounds
            for r in range(args.ttft_rounds):
                if r:  # a fresh server and a fresh offline engine: each process lays out its memory anew
                    server.stop()
                    server = OwnServer(args.model, server_flags(args))
                    url = server.url
                    engine = build_engine(args)
                    time_to_first_token(engine, "warm-up", requests[0][0], 1)
                chunk = fresh_prompts[r * size : (r + 1) * size]
                rounds.append(asyncio.run(paired_ttft(url, args.served_model, args.api_key, engine, chunk)))
            offline = {"output_tokens_per_s": batch.output_tokens / batch.wall_s, "paired_ttft": pooled_pairs(rounds)}
    finally:
        if server:
            server.stop()
    result = {
        "command": "serve",
        "base_url": None if own else url,
        "concurrency": args.concurrency,
        "request_rate": args.request_rate,
        "num_requests": len(requests),
        "prompt_fingerprint": fingerprint([p for p, _ in requests]),
        "heteroserve": serving,
        "peers": {},
        "latency_samples_ms": {
            "TTFT": [1000 * t.ttft_s for t in timings if t.ttft_s is not None],
            "inter-token": [1000 * x for t in timings for x in t.inter_token_s],
        },
        "_platform": resolve_platform(args.device),
    }
    print(
        f"server: {serving['output_tokens_per_s']:.1f} output tok/s over {len(requests)} requests at concurrency "
        f"{args.concurrency}; TTFT p50 {serving['ttft_ms']['p50']:.0f} ms p99 {serving['ttft_ms']['p99']:.0f} ms; "
        f"inter-token p50 {serving['inter_token_ms']['p50']:.1f} ms; errors {len(serving['errors'])}"
    )
    if via_gateway is not None:
        _report_gateway(result, serving, via_gateway)
    if offline is not None:
        _report_offline(result, serving, offline)
    write_report(args, result)


def _report_gateway(result: dict, serving: dict, via_gateway: dict) -> None:
    result["via_gateway"] = via_gateway
    result["gateway_throughput_ratio"] = via_gateway["output_tokens_per_s"] / serving["output_tokens_per_s"]
    pairs = via_gateway["paired_ttft"]
    result["gateway_ttft_overhead_ms"] = pairs["overhead_p50_ms"]
    gateway_p50, direct_p50 = (run["concurrency_1"]["ttft_ms"]["p50"] for run in (via_gateway, serving))
    print(
        f"through the gateway: {via_gateway['output_tokens_per_s']:.1f} output tok/s "
        f"({result['gateway_throughput_ratio']:.0%} of direct); TTFT at concurrency 1 over {pairs['pairs']} "
        f"paired requests: median difference {pairs['overhead_p50_ms']:+.1f} ms (p50 through the gateway "
        f"{gateway_p50:.1f} ms, direct {direct_p50:.1f} ms)"
    )


def _report_offline(result: dict, serving: dict, offline: dict) -> None:
    result["offline"] = offline
    result["server_vs_offline_throughput"] = serving["output_tokens_per_s"] / offline["output_tokens_per_s"]
    pairs = offline["paired_ttft"]
    result["server_ttft_overhead_ms"] = pairs["overhead_p50_ms"]
    print(
        f"offline engine: {offline['output_tokens_per_s']:.1f} output tok/s -> server reaches "
        f"{result['server_vs_offline_throughput']:.0%}; TTFT at concurrency 1 over {pairs['pairs']} paired fresh "
        f"prompts: server p50 {pairs['server_ttft_p50_ms']:.1f} ms, offline {pairs['offline_ttft_p50_ms']:.1f} ms, "
        f"median difference +{pairs['overhead_p50_ms']:.1f} ms"
        + (
            f" (rounds: {', '.join(f'{d:+.1f}' for d in pairs['overhead_p50_ms_per_round'])})"
            if pairs["rounds"] > 1
            else ""
        )
    )
