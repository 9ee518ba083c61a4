"""`heteroserve bench serve`: scenario C against a server (ours or any OpenAI-compatible one), optionally through
the gateway, and compared with the offline engine on the same requests."""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from dataclasses import dataclass, fields

import httpx

from heteroserve.bench.engine_runs import run_batch, time_to_first_token
from heteroserve.bench.harness import build_engine, dataset, write_report
from heteroserve.bench.serve import OwnServer, run_clients, start_gateway, summarize
from heteroserve.bench.serve_pairs import (
    TTFT_OUTPUT_LEN,
    alternate_throughput,
    offline_throughput,
    paired_gateway_ttft,
    paired_ttft,
    pooled_pairs,
    pooled_rounds,
    served_throughput,
)
from heteroserve.bench.workload import fingerprint
from heteroserve.engine.engine_args import EngineArgs, cli_flag
from heteroserve.model.loader import load_tokenizer
from heteroserve.model.loader.source import resolve_model
from heteroserve.platforms import resolve_platform


def server_flags(args: argparse.Namespace) -> list[str]:
    """Every engine flag of this bench run that differs from its default, for the server it starts (the server
    takes the same EngineArgs flags, so none is dropped on the way)."""
    defaults = EngineArgs()
    flags: list[str] = []
    for setting in fields(EngineArgs):
        value = getattr(args, setting.name, None) if setting.name != "model" else None
        if setting.name == "model" or value == getattr(defaults, setting.name):
            continue
        flag = cli_flag(setting.name)
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


@dataclass
class ServePrompts:
    """Scenario C's requests, and prompts of their own for the concurrency-1 runs, the paired TTFT rounds and each
    later throughput round, so no side finds another's prompts in its prefix cache."""

    requests: list[tuple[list[int], int]]
    single: list[list[int]]
    fresh: list[list[int]]
    later_rounds: list[list[tuple[list[int], int]]]


def _check_args(args: argparse.Namespace) -> tuple[bool, bool]:
    """Fills the defaults and refuses contradictory flags; (own server, compare with the offline engine)."""
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
    if any(peer != "vllm" for peer in args.peer):
        raise SystemExit("bench serve's only peer is vllm (its OpenAI server)")
    if args.rounds < 1 or (args.rounds > 1 and not (compare or args.gateway or args.peer)):
        raise SystemExit("--rounds must be at least 1, and above 1 only with --compare-offline, --gateway or --peer")
    return own, compare


def _prompts(args: argparse.Namespace) -> ServePrompts:
    tokenizer = load_tokenizer(resolve_model(args.model))
    vocab = len(tokenizer) if tokenizer is not None else 0
    n, singles = args.num_requests, args.ttft_requests
    wanted = n * args.rounds + 2 * singles
    every = dataset(tokenizer, vocab, args, "C", wanted)
    if len(every) < wanted:
        raise SystemExit(
            f"{args.dataset} has {len(every)} prompts; this run needs {wanted} "
            "(--num-requests x --rounds + 2 x --ttft-requests)"
        )
    return ServePrompts(
        requests=every[:n],
        single=[p for p, _ in every[n : n + singles]],
        fresh=[p for p, _ in every[n + singles : n + 2 * singles]],
        later_rounds=[every[n + 2 * singles + r * n : n + 2 * singles + (r + 1) * n] for r in range(args.rounds - 1)],
    )


def _measure(target: str, model: str | None, prompts: ServePrompts, args: argparse.Namespace) -> tuple[dict, list]:
    """Scenario C's clients against `target`, then the concurrency-1 requests one at a time."""
    asyncio.run(run_clients(target, prompts.requests[:1], 1, None, model, args.api_key))  # warm-up
    wall, timings = asyncio.run(
        run_clients(target, prompts.requests, args.concurrency, args.request_rate, model, args.api_key, args.seed)
    )
    summary = summarize(wall, timings)
    one_at_a_time = [(p, TTFT_OUTPUT_LEN) for p in prompts.single]
    ttft_wall, ttft_timings = asyncio.run(run_clients(target, one_at_a_time, 1, None, model, args.api_key))
    summary["concurrency_1"] = summarize(ttft_wall, ttft_timings)
    return summary, timings


def _offline_comparison(serving: dict, direct, prompts: ServePrompts, args: argparse.Namespace) -> tuple[dict, object]:
    """The offline engine on the same requests, throughput rounds alternating with the server's (the server idles
    while the offline engine runs, and the other way round); also returns the engine for the paired TTFT."""
    engine = build_engine(args)
    batch = run_batch(engine, prompts.requests)
    offline_s = batch.output_tokens / batch.wall_s
    pairs = alternate_throughput(
        (serving["output_tokens_per_s"], offline_s), direct, offline_throughput(engine), prompts.later_rounds
    )
    ratios = [server / offline for server, offline in pairs]
    rounds = pooled_rounds(pairs, ("server", "offline"), ratios)
    return {"output_tokens_per_s": offline_s, "throughput_rounds": rounds}, engine


def _gateway_comparison(url: str, serving: dict, direct, prompts: ServePrompts, args: argparse.Namespace) -> dict:
    """The same clients through a gateway in front of the server: throughput rounds and paired TTFT."""
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    with tempfile.TemporaryDirectory() as folder:
        gateway = start_gateway(url, model, folder)
        try:
            via_gateway, _ = _measure(gateway.url, model, prompts, args)
            first = (serving["output_tokens_per_s"], via_gateway["output_tokens_per_s"])
            through = served_throughput(gateway.url, args, model)
            pairs = alternate_throughput(first, direct, through, prompts.later_rounds)
            ratios = [gateway_s / direct_s for direct_s, gateway_s in pairs]
            via_gateway["throughput_rounds"] = pooled_rounds(pairs, ("direct", "gateway"), ratios)
            ttft_pairs = paired_gateway_ttft(url, gateway.url, model, args.api_key, prompts.single)
            via_gateway["paired_ttft"] = asyncio.run(ttft_pairs)
        finally:
            gateway.stop()
    return via_gateway


def _vllm_comparison(serving: dict, direct, prompts: ServePrompts, args: argparse.Namespace) -> dict:
    """vLLM's OpenAI server on the same weights and the same clients as ours: its first round right after ours,
    then later rounds alternating which server goes first (each idles while the other is measured)."""
    from heteroserve.bench.peers.hf_folder import hf_checkpoint_folder
    from heteroserve.bench.peers.vllm_peer import SERVED_MODEL_NAME, start_vllm_server, vllm_dtype

    folder = hf_checkpoint_folder(resolve_model(args.model))
    dtype = vllm_dtype(args.dtype, folder)
    print("starting vLLM's OpenAI server (the first start compiles for minutes)")
    server = start_vllm_server(folder, dtype, args.max_model_len, args.enable_prefix_caching)
    try:
        theirs, _ = _measure(server.url, SERVED_MODEL_NAME, prompts, args)
        first = (serving["output_tokens_per_s"], theirs["output_tokens_per_s"])
        through = served_throughput(server.url, args, SERVED_MODEL_NAME)
        pairs = alternate_throughput(first, direct, through, prompts.later_rounds)
    finally:
        server.stop()
    ratios = [ours / vllm for ours, vllm in pairs]
    theirs["throughput_rounds"] = pooled_rounds(pairs, ("heteroserve", "vllm"), ratios)
    theirs["heteroserve_ratio"] = theirs["throughput_rounds"]["ratio"]
    theirs["weights"] = f"{folder} in {dtype}"
    return theirs


def run_serve_bench(args: argparse.Namespace) -> None:
    own, compare = _check_args(args)
    prompts = _prompts(args)
    server = OwnServer(args.model, server_flags(args)) if own else None
    url = server.url if own else args.base_url.rstrip("/")
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        httpx.get(f"{url}/v1/models", timeout=10, headers=headers).raise_for_status()
    except httpx.HTTPError as exc:
        if server:
            server.stop()
        raise SystemExit(f"cannot reach an OpenAI-compatible server at {url}: {exc}") from exc

    via_gateway = offline = None
    peers: dict[str, dict] = {}
    try:
        serving, timings = _measure(url, args.served_model, prompts, args)
        direct = served_throughput(url, args, args.served_model)
        if args.peer:  # before the other comparisons, so no later round's prompts are in our prefix cache yet
            from heteroserve.bench.peers.vllm_peer import vllm_missing

            missing = vllm_missing()
            if missing is not None:
                print(f"skipping the vllm peer: {missing}")
                peers["vllm"] = {"skipped": missing}
            else:
                peers["vllm"] = _vllm_comparison(serving, direct, prompts, args)
        if compare:
            offline, engine = _offline_comparison(serving, direct, prompts, args)
        if args.gateway:
            via_gateway = _gateway_comparison(url, serving, direct, prompts, args)
        if compare:
            rounds = []
            size = len(prompts.fresh) // args.ttft_rounds
            for r in range(args.ttft_rounds):
                if r:  # a fresh server and a fresh offline engine: each process lays out its memory anew
                    server.stop()
                    server = OwnServer(args.model, server_flags(args))
                    url = server.url
                    engine = build_engine(args)
                    time_to_first_token(engine, "warm-up", prompts.requests[0][0], 1)
                chunk = prompts.fresh[r * size : (r + 1) * size]
                rounds.append(asyncio.run(paired_ttft(url, args.served_model, args.api_key, engine, chunk)))
            offline["paired_ttft"] = pooled_pairs(rounds)
    finally:
        if server:
            server.stop()
    requests = prompts.requests
    result = {
        "command": "serve",
        "base_url": None if own else url,
        "concurrency": args.concurrency,
        "request_rate": args.request_rate,
        "num_requests": len(requests),
        "rounds": args.rounds,
        "prompt_fingerprint": fingerprint([p for p, _ in requests]),
        "heteroserve": serving,
        "peers": peers,
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
    if "throughput_rounds" in peers.get("vllm", {}):
        _report_vllm(peers["vllm"])
    if via_gateway is not None:
        _report_gateway(result, serving, via_gateway)
    if offline is not None:
        _report_offline(result, offline)
    write_report(args, result)


def _report_gateway(result: dict, serving: dict, via_gateway: dict) -> None:
    result["via_gateway"] = via_gateway
    result["gateway_throughput_ratio"] = via_gateway["throughput_rounds"]["ratio"]
    pairs = via_gateway["paired_ttft"]
    result["gateway_ttft_overhead_ms"] = pairs["overhead_p50_ms"]
    gateway_p50, direct_p50 = (run["concurrency_1"]["ttft_ms"]["p50"] for run in (via_gateway, serving))
    print(
        f"through the gateway: {via_gateway['output_tokens_per_s']:.1f} output tok/s "
        f"({result['gateway_throughput_ratio']:.0%} of direct{_over_rounds(via_gateway)}); "
        f"TTFT at concurrency 1 over {pairs['pairs']} "
        f"paired requests: median difference {pairs['overhead_p50_ms']:+.1f} ms (p50 through the gateway "
        f"{gateway_p50:.1f} ms, direct {direct_p50:.1f} ms)"
    )


def _report_vllm(theirs: dict) -> None:
    print(
        f"vLLM's server: {theirs['output_tokens_per_s']:.1f} output tok/s; TTFT p50 {theirs['ttft_ms']['p50']:.0f} "
        f"ms; inter-token p50 {theirs['inter_token_ms']['p50']:.1f} ms -> heteroserve reaches "
        f"{theirs['heteroserve_ratio']:.0%} of its throughput{_over_rounds(theirs)}"
    )


def _report_offline(result: dict, offline: dict) -> None:
    result["offline"] = offline
    result["server_vs_offline_throughput"] = offline["throughput_rounds"]["ratio"]
    pairs = offline["paired_ttft"]
    result["server_ttft_overhead_ms"] = pairs["overhead_p50_ms"]
    print(
        f"offline engine: {offline['output_tokens_per_s']:.1f} output tok/s -> server reaches "
        f"{result['server_vs_offline_throughput']:.0%}{_over_rounds(offline)}; "
        f"TTFT at concurrency 1 over {pairs['pairs']} paired fresh "
        f"prompts: server p50 {pairs['server_ttft_p50_ms']:.1f} ms, offline {pairs['offline_ttft_p50_ms']:.1f} ms, "
        f"median difference +{pairs['overhead_p50_ms']:.1f} ms"
        + (
            f" (rounds: {', '.join(f'{d:+.1f}' for d in pairs['overhead_p50_ms_per_round'])})"
            if pairs["rounds"] > 1
            else ""
        )
    )


def _over_rounds(side: dict) -> str:
    rounds = side["throughput_rounds"]
    if rounds["rounds"] == 1:
        return ""
    return f", the median of {rounds['rounds']} rounds: {', '.join(f'{r:.0%}' for r in rounds['rounds_ratio'])}"
