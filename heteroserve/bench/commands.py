"""`heteroserve bench throughput|latency`: our engine and the transformers peer on the same prompts."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from heteroserve.bench.engine_runs import run_batch, single_stream, time_to_first_token
from heteroserve.bench.machine import describe_machine
from heteroserve.bench.workload import fingerprint, jsonl_requests, random_requests, scenario_requests
from heteroserve.engine.llm_engine import LLMEngine
from heteroserve.entrypoints.engine_args import add_engine_args, engine_config_from_args

PEERS = ("hf",)


def add_bench_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmark heteroserve against peers on the shared workload")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    for name, handler in (("throughput", _throughput), ("latency", _latency), ("serve", _serve)):
        sub = kinds.add_parser(name, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        sub.add_argument("model", nargs="?", default=None)
        sub.add_argument("--peer", action="append", default=[], help=f"also run a peer: {', '.join(PEERS)}")
        sub.add_argument("--output-json", type=Path, default=None)
        sub.add_argument("--plot", type=Path, default=None, help="write a PNG chart of the results")
        sub.add_argument(
            "--dataset", default="workload", help="workload (WORKLOAD.md prompts), random, or a JSONL file of prompts"
        )
        add_engine_args(sub)
        sub.set_defaults(handler=handler)
        if name == "throughput":
            sub.add_argument("--scenario", choices=["B", "D"], default="B")
            sub.add_argument("--num-requests", type=int, default=64)
            sub.add_argument("--input-len", type=int, default=128)
            sub.add_argument("--output-len", type=int, default=128)
            sub.add_argument("--hf-batch", default="1,8,64", help="transformers static batch sizes to run")
            sub.add_argument(
                "--hf-requests",
                type=int,
                default=None,
                help="run transformers batch size 1 on this many requests and scale (cost is linear)",
            )
        elif name == "latency":
            sub.add_argument("--input-len", type=int, default=32)
            sub.add_argument("--output-len", type=int, default=128)
            sub.add_argument("--repeats", type=int, default=3)
        else:
            sub.add_argument("--base-url", default=None, help="server to measure (default: start our own)")
            sub.add_argument("--served-model", default=None, help="model name to send (default: none)")
            sub.add_argument("--api-key", default=None)
            sub.add_argument("--concurrency", type=int, default=16)
            sub.add_argument("--num-requests", type=int, default=16)
            sub.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
            sub.add_argument("--input-len", type=int, default=128)
            sub.add_argument("--output-len", type=int, default=64)
            sub.add_argument(
                "--gateway",
                action="store_true",
                help="also measure the same server through `heteroserve gateway` (prefix caching off)",
            )
            sub.add_argument(
                "--compare-offline",
                action=argparse.BooleanOptionalAction,
                default=None,
                help="also run the requests in-process (default: on when starting our own server)",
            )
            sub.add_argument(
                "--ttft-requests",
                type=int,
                default=20,
                help="requests at concurrency 1 for the server-vs-offline TTFT comparison",
            )


def _engine(args: argparse.Namespace) -> LLMEngine:
    for peer in args.peer:
        if peer not in PEERS:
            raise SystemExit(f"unknown peer {peer!r}; known: {', '.join(PEERS)}")
    if args.max_model_len is None:
        args.max_model_len = 2048
    return LLMEngine(engine_config_from_args(args.model, args))


def _requests(engine: LLMEngine, args, scenario: str, num: int):
    if args.input_len >= engine.max_model_len:
        raise SystemExit(f"--input-len {args.input_len} does not fit max_model_len={engine.max_model_len}")
    return _dataset(engine.tokenizer, engine.vocab_size, args, scenario, num)


def _dataset(tokenizer, vocab_size: int, args, scenario: str, num: int):
    if args.dataset == "random":
        return random_requests(vocab_size, num, args.input_len, args.output_len, args.seed)
    if tokenizer is None:
        raise SystemExit("this model has no tokenizer: use --dataset random")
    if args.dataset == "workload":
        return scenario_requests(tokenizer.encode, scenario, num, args.input_len, args.output_len)
    if not Path(args.dataset).is_file():
        raise SystemExit(f"--dataset {args.dataset!r} is neither workload, random nor a JSONL file")
    return jsonl_requests(args.dataset, tokenizer.encode, args.output_len)[:num]


def _hf_peer(engine: LLMEngine):
    from heteroserve.bench.hf_peer import HFPeer
    from heteroserve.model.loader.source import resolve_model

    return HFPeer(resolve_model(engine.config.model.model), engine.dtype)


def _report(args, result: dict) -> None:
    result["machine"] = describe_machine(result.pop("_platform"))
    result["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if args.plot:
        from heteroserve.bench.plot import plot_result

        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot_result(result, args.plot)
        print(f"wrote {args.plot}")
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.output_json}")


def _match_rate(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Fraction of requests whose greedy tokens equal the peer's exactly."""
    return sum(a == b for a, b in zip(ours, theirs, strict=False)) / max(len(theirs), 1)


def _throughput(args) -> None:
    engine = _engine(args)
    requests = _requests(engine, args, args.scenario, args.num_requests)
    run = run_batch(engine, requests)
    result = {
        "command": "throughput",
        "scenario": args.scenario,
        "num_requests": len(requests),
        "prompt_fingerprint": fingerprint([p for p, _ in requests]),
        "heteroserve": {
            "wall_s": run.wall_s,
            "requests_per_s": len(requests) / run.wall_s,
            "output_tokens": run.output_tokens,
            "output_tokens_per_s": run.output_tokens / run.wall_s,
            "total_tokens_per_s": (run.output_tokens + run.prompt_tokens) / run.wall_s,
            "peak_kv_blocks": run.peak_kv_blocks,
            "kv_blocks_needed": run.kv_blocks_needed,
            "kv_blocks_allocated": run.kv_blocks_allocated,
            "peak_rss_mib": run.peak_rss_mib,
            "steps": run.num_steps,
            "preemptions": run.num_preemptions,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "quantization": engine.config.model.quantization or "as checkpoint",
            "weight_bytes": engine.weight_bytes,
        },
        "peers": {},
        "latency_samples_ms": {"heteroserve request e2e": [1000 * x for x in run.e2e_s]},
        "_platform": engine.platform,
    }
    print(
        f"heteroserve: {run.wall_s:.1f} s, {run.output_tokens / run.wall_s:.1f} output tok/s, "
        f"peak KV blocks {run.peak_kv_blocks} (needed {run.kv_blocks_needed}, allocated {run.kv_blocks_allocated})"
    )
    if "hf" in args.peer:
        peer = _hf_peer(engine)
        for batch in (int(b) for b in args.hf_batch.split(",") if b):
            subset = requests
            if batch == 1 and args.hf_requests:
                subset = requests[: args.hf_requests]
            peer_run = peer.run_batches(subset, batch)
            scale = len(requests) / len(subset)
            wall = peer_run.wall_s * scale
            tps = peer_run.output_tokens / peer_run.wall_s
            label = f"hf_static_{batch}" if batch > 1 else "hf_one_at_a_time"
            result["peers"][label] = {
                "wall_s": wall,
                "measured_requests": len(subset),
                "scaled": scale != 1,
                "output_tokens_per_s": tps,
                "heteroserve_ratio": (run.output_tokens / run.wall_s) / tps,
                "greedy_match_rate": _match_rate(run.outputs, peer_run.outputs),
            }
            note = f" (measured on {len(subset)} requests, scaled)" if scale != 1 else ""
            print(
                f"{label}: {wall:.1f} s{note}, {tps:.1f} output tok/s -> heteroserve is "
                f"{result['peers'][label]['heteroserve_ratio']:.2f}x; identical greedy outputs "
                f"{_match_rate(run.outputs, peer_run.outputs):.0%}"
            )
    _report(args, result)


def _latency(args) -> None:
    engine = _engine(args)
    prompt = _requests(engine, args, "A", 1)[0][0]
    ours = single_stream(engine, prompt, args.output_len, args.repeats)
    samples = ours.pop("inter_token_samples_ms")
    ours["quantization"] = engine.config.model.quantization or "as checkpoint"
    ours["weight_bytes"] = engine.weight_bytes
    result = {
        "command": "latency",
        "input_len": len(prompt),
        "output_len": args.output_len,
        "heteroserve": ours,
        "peers": {},
        "latency_samples_ms": {"heteroserve inter-token": samples},
        "_platform": engine.platform,
    }
    print(f"heteroserve: prefill {ours['prefill_ms']:.1f} ms, decode {ours['decode_tokens_per_s']:.1f} tok/s")
    if "hf" in args.peer:
        theirs = _hf_peer(engine).single_stream(prompt, args.output_len, args.repeats)
        theirs["decode_ratio"] = ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]
        theirs["prefill_ratio"] = theirs["prefill_ms"] / ours["prefill_ms"]
        result["peers"]["hf"] = theirs
        print(
            f"hf: prefill {theirs['prefill_ms']:.1f} ms, decode {theirs['decode_tokens_per_s']:.1f} tok/s -> "
            f"heteroserve decode {theirs['decode_ratio']:.2f}x, prefill {theirs['prefill_ratio']:.2f}x faster"
        )
    _report(args, result)


def _server_flags(args) -> list[str]:
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


def _serve(args) -> None:
    import asyncio

    import httpx

    from heteroserve.bench.serve import OwnServer, run_clients, start_gateway, summarize
    from heteroserve.model.loader import load_tokenizer
    from heteroserve.model.loader.source import resolve_model
    from heteroserve.platforms import resolve_platform

    if args.max_model_len is None:
        args.max_model_len = 2048
    if args.gateway:
        if args.base_url is not None:
            raise SystemExit("--gateway measures our own server directly and through a gateway: drop --base-url")
        args.enable_prefix_caching = False  # the same prompts run twice; cache hits would favour the second run
    own = args.base_url is None
    compare = own if args.compare_offline is None else args.compare_offline
    tokenizer = load_tokenizer(resolve_model(args.model))
    vocab = len(tokenizer) if tokenizer is not None else 0
    requests = _dataset(tokenizer, vocab, args, "C", args.num_requests)
    # Concurrency-1 requests use prompts of their own, so neither side finds them in its prefix cache.
    single = _dataset(tokenizer, vocab, args, "C", args.num_requests + args.ttft_requests)[args.num_requests :]
    single = [(p, 8) for p, _ in single]
    server = OwnServer(args.model, _server_flags(args)) if own else None
    url = server.url if own else args.base_url.rstrip("/")
    try:
        httpx.get(
            f"{url}/v1/models", timeout=10, headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        ).raise_for_status()
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
        ttft_wall, ttft_timings = asyncio.run(run_clients(target, single, 1, None, model, args.api_key))
        summary["concurrency_1"] = summarize(ttft_wall, ttft_timings)
        return summary, timings

    via_gateway = None
    try:
        serving, timings = measure(url, args.served_model)
        if args.gateway:
            import tempfile

            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            with tempfile.TemporaryDirectory() as folder:
                gateway = start_gateway(url, model, folder)
                try:
                    via_gateway, _ = measure(gateway.url, model)
                finally:
                    gateway.stop()
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
    if via_gateway is not None:
        result["via_gateway"] = via_gateway
        result["gateway_throughput_ratio"] = via_gateway["output_tokens_per_s"] / serving["output_tokens_per_s"]
        result["gateway_ttft_overhead_ms"] = (
            via_gateway["concurrency_1"]["ttft_ms"]["p50"] - serving["concurrency_1"]["ttft_ms"]["p50"]
        )
        print(
            f"through the gateway: {via_gateway['output_tokens_per_s']:.1f} output tok/s "
            f"({result['gateway_throughput_ratio']:.0%} of direct); TTFT p50 at concurrency 1 "
            f"{via_gateway['concurrency_1']['ttft_ms']['p50']:.1f} ms vs direct "
            f"{serving['concurrency_1']['ttft_ms']['p50']:.1f} ms (+{result['gateway_ttft_overhead_ms']:.1f} ms)"
        )
    print(
        f"server: {serving['output_tokens_per_s']:.1f} output tok/s over {len(requests)} requests at concurrency "
        f"{args.concurrency}; TTFT p50 {serving['ttft_ms']['p50']:.0f} ms p99 {serving['ttft_ms']['p99']:.0f} ms; "
        f"inter-token p50 {serving['inter_token_ms']['p50']:.1f} ms; errors {len(serving['errors'])}"
    )
    if compare:
        engine = _engine(args)
        offline = run_batch(engine, requests)
        offline_tps = offline.output_tokens / offline.wall_s
        first_token_ms = sorted(
            1000 * time_to_first_token(engine, f"ttft-{i}", prompt, 8) for i, (prompt, _) in enumerate(single)
        )
        offline_ttft = first_token_ms[len(first_token_ms) // 2]
        result["offline"] = {"output_tokens_per_s": offline_tps, "ttft_p50_ms_concurrency_1": offline_ttft}
        result["server_vs_offline_throughput"] = serving["output_tokens_per_s"] / offline_tps
        result["server_ttft_overhead_ms"] = serving["concurrency_1"]["ttft_ms"]["p50"] - offline_ttft
        print(
            f"offline engine: {offline_tps:.1f} output tok/s -> server reaches "
            f"{result['server_vs_offline_throughput']:.0%}; TTFT p50 at concurrency 1: server "
            f"{serving['concurrency_1']['ttft_ms']['p50']:.1f} ms vs offline {offline_ttft:.1f} ms "
            f"(+{result['server_ttft_overhead_ms']:.1f} ms)"
        )
    _report(args, result)
