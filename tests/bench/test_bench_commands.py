"""`heteroserve bench` subcommands, run as real processes on small workloads (no timing thresholds)."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys

import pytest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["--max-model-len", "128", "--kv-cache-memory-bytes", str(16 * 1024**2)]


def bench(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run(
        [sys.executable, "-m", "heteroserve.entrypoints.cli", "bench", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if check:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def test_throughput_with_hf_peer_over_two_rounds(tmp_path):
    """Ours and every transformers configuration twice, alternating: each ratio is the median of the rounds'
    pairs, and the second round starts without the first one's cached prompts."""
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    bench(
        "throughput",
        *("--num-requests", "3", "--input-len", "40", "--output-len", "4"),
        *("--peer", "hf", "--hf-batch", "1,2", "--hf-requests", "1", "--rounds", "2"),
        *("--output-json", str(out), "--plot", str(png)),
        *SMALL,
    )
    result = json.loads(out.read_text())
    ours = result["heteroserve"]
    assert result["rounds"] == 2 and len(ours["rounds_wall_s"]) == 2
    assert ours["wall_s"] == min(ours["rounds_wall_s"])  # the lower middle of two rounds
    assert ours["rounds_prefix_cache_hit_tokens"] == [0, 0]  # 2 full blocks a prompt would be cached otherwise
    assert ours["output_tokens"] == 3 * 4
    for key in ("wall_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "peak_rss_mib"):
        assert ours[key] > 0, key
    assert ours["kv_blocks_needed"] == 3 * 3 and 0 < ours["peak_kv_blocks"] <= ours["kv_blocks_allocated"]
    assert ours["kv_cache_dtype"] == "float32"
    assert ours["speculative"] is None and ours["spec_draft_tokens"] == 0 and ours["spec_acceptance_rate"] is None
    one, two = result["peers"]["hf_one_at_a_time"], result["peers"]["hf_static_2"]
    assert one["measured_requests"] == 1 and one["scaled"] and not two["scaled"]
    for peer in (one, two):
        assert peer["output_tokens_per_s"] > 0 and peer["heteroserve_ratio"] > 0
        assert 0 <= peer["greedy_match_rate"] <= 1
        ratios = peer["rounds_heteroserve_ratio"]
        assert len(ratios) == len(peer["rounds_wall_s"]) == 2 and min(ratios) > 0
        assert peer["heteroserve_ratio"] == pytest.approx(statistics.median(ratios))
    assert two["greedy_match_rate"] == 1.0  # same greedy tokens as transformers on these prompts
    machine = result["machine"]
    assert machine["cores"] >= 1 and machine["torch"] and "isa" in machine
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_throughput_with_a_json_schema_per_request(tmp_path):
    """The same batch plain and under grammars, alternating over two rounds: equal output lengths (the schema needs
    more tokens than the output has), and the cost as the median of the rounds' throughput ratios."""
    out = tmp_path / "s.json"
    bench(
        "throughput",
        *("--num-requests", "3", "--input-len", "24", "--output-len", "6", "--rounds", "2"),
        *("--structured", "json-schema", "--output-json", str(out)),
        *SMALL,
    )
    result = json.loads(out.read_text())
    plain, structured = result["heteroserve"], result["structured"]
    assert structured["constraint"] == "json-schema"
    assert plain["output_tokens"] == structured["output_tokens"] == 3 * 6
    ratios = structured["rounds_throughput_vs_plain"]
    assert len(ratios) == 2 and min(ratios) > 0
    assert structured["throughput_vs_plain"] == pytest.approx(statistics.median(ratios))
    assert len(structured["rounds_wall_s"]) == len(plain["rounds_wall_s"]) == 2


def test_throughput_with_lora_adapters(tmp_path):
    """The batch on the base model and with two random adapters spread over it, alternating over two rounds."""
    out = tmp_path / "l.json"
    bench(
        "throughput",
        *("--num-requests", "4", "--input-len", "16", "--output-len", "4", "--rounds", "2"),
        *("--lora-adapters", "2", "--lora-rank", "4", "--output-json", str(out)),
        *SMALL,
    )
    result = json.loads(out.read_text())
    base, lora = result["heteroserve"], result["lora"]
    assert (lora["adapters"], lora["rank"], lora["max_loras"]) == (2, 4, 2)
    assert base["output_tokens"] == lora["output_tokens"] == 4 * 4
    ratios = lora["rounds_throughput_vs_base"]
    assert len(ratios) == 2 and min(ratios) > 0
    assert lora["throughput_vs_base"] == pytest.approx(statistics.median(ratios))


def test_throughput_scenario_d_and_latency(tmp_path):
    out = tmp_path / "d.json"
    bench(
        "throughput",
        *("--scenario", "D", "--num-requests", "2", "--kv-cache-dtype", "float16"),
        *("--output-json", str(out), "--max-model-len", "512"),
    )
    result = json.loads(out.read_text())
    assert result["scenario"] == "D" and result["heteroserve"]["output_tokens"] == 16 + 69  # G = 16 + 53 i mod 241
    assert result["heteroserve"]["kv_cache_dtype"] == "float16"
    lat = tmp_path / "a.json"
    bench(
        "latency",
        "--input-len",
        "8",
        "--output-len",
        "6",
        "--repeats",
        "1",
        "--rounds",
        "2",
        "--peer",
        "hf",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3}',
        "--output-json",
        str(lat),
        *SMALL,
    )
    result = json.loads(lat.read_text())
    ours = result["heteroserve"]
    assert ours["prefill_ms"] > 0 and ours["decode_tokens_per_s"] > 0
    assert ours["kv_cache_dtype"] == "float32"
    assert ours["speculative"]["num_speculative_tokens"] == 3
    assert 0 <= ours["spec_accepted_tokens"] <= ours["spec_draft_tokens"]
    # one inter-token sample per token after the first, however many tokens a speculative step brought
    assert len(result["latency_samples_ms"]["heteroserve inter-token"]) == 6 - 1
    assert ours["decode_tokens_per_s"] == min(ours["rounds_decode_tokens_per_s"])  # the lower middle of two rounds
    hf = result["peers"]["hf"]
    assert len(hf["rounds_decode_tokens_per_s"]) == len(ours["rounds_prefill_ms"]) == 2
    ours_decode, hf_decode = ours["rounds_decode_tokens_per_s"], hf["rounds_decode_tokens_per_s"]
    assert hf["rounds_decode_ratio"] == pytest.approx([o / t for o, t in zip(ours_decode, hf_decode, strict=True)])
    assert hf["decode_ratio"] == pytest.approx(statistics.median(hf["rounds_decode_ratio"])) and hf["decode_ratio"] > 0
    assert hf["prefill_ratio"] == pytest.approx(statistics.median(hf["rounds_prefill_ratio"]))


def test_llama_cpp_peer_runs_the_same_gguf_or_says_why_not(tmp_path):
    """With llama-cpp-python installed (the [llama-cpp] extra) the peer runs the default GGUF one request at a
    time; without it the run still completes and the result says the peer was skipped and why."""
    out = tmp_path / "l.json"
    bench(
        "throughput",
        "--num-requests",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "5",
        "--peer",
        "llama-cpp",
        "--output-json",
        str(out),
        *SMALL,
    )
    peers = json.loads(out.read_text())["peers"]
    if importlib.util.find_spec("llama_cpp") is None:
        assert "llama-cpp-python is not installed" in peers["llama-cpp"]["skipped"]
        return
    run = peers["llama-cpp_one_at_a_time"]
    assert run["output_tokens_per_s"] > 0 and run["measured_requests"] == 2 and 0 <= run["greedy_match_rate"] <= 1


def test_serve_against_a_running_server(server, tmp_path):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    bench(
        "serve",
        "--base-url",
        server.base_url,
        "--num-requests",
        "4",
        "--concurrency",
        "2",
        "--input-len",
        "16",
        "--output-len",
        "5",
        "--ttft-requests",
        "2",
        "--compare-offline",
        "--output-json",
        str(out),
        "--plot",
        str(png),
        *SMALL,
    )
    result = json.loads(out.read_text())
    serving = result["heteroserve"]
    assert serving["errors"] == [] and serving["output_tokens"] == 4 * 5
    assert serving["ttft_ms"]["p50"] > 0 and serving["inter_token_ms"]["p99"] >= serving["inter_token_ms"]["p50"]
    assert serving["concurrency_1"]["requests"] == 2
    pairs = result["offline"]["paired_ttft"]
    assert pairs["pairs"] == len(pairs["overhead_samples_ms"]) == 2
    assert result["server_ttft_overhead_ms"] == pytest.approx(sum(pairs["overhead_samples_ms"]) / 2)
    assert result["offline"]["output_tokens_per_s"] > 0 and result["server_vs_offline_throughput"] > 0
    assert png.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize(
    "args, message",
    [
        (["throughput", "--input-len", "200", *SMALL], "does not fit max_model_len=128"),
        (["throughput", "--peer", "nope", *SMALL], "unknown peer"),
        (["throughput", "--rounds", "0", *SMALL], "--rounds must be at least 1"),
        (["throughput", "--structured", "json-schema", "--peer", "hf", "--input-len", "16", *SMALL], "without --peer"),
        (["latency", "--rounds", "0", *SMALL], "--rounds must be at least 1"),
        (["serve", "--base-url", "http://127.0.0.1:9", "--num-requests", "1", "--input-len", "8"], "cannot reach"),
        (["throughput", "--dataset", "/no/such/file.jsonl", "--input-len", "16", *SMALL], "neither workload"),
        (["serve", "--base-url", "http://127.0.0.1:9", "--ttft-rounds", "2"], "restarts the server"),
        (["serve", "--ttft-requests", "2", "--ttft-rounds", "3"], "between 1 and --ttft-requests"),
        (["serve", "--base-url", "http://127.0.0.1:9", "--rounds", "2"], "above 1 only with --compare-offline"),
        (["serve", "--peer", "hf"], "only peer is vllm"),
        (["latency", "--speculative-config", '{"method": "eagle"}'], "speculative method must be one of ngram"),
        (["latency", "--speculative-config", "ngram"], "invalid speculative config"),
    ],
)
def test_bad_arguments(args, message):
    result = bench(*args, check=False)
    assert result.returncode != 0
    assert message in result.stderr + result.stdout


def test_serve_refuses_a_prompt_file_too_short_for_its_rounds(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {i}?"}) + "\n" for i in range(5)))
    result = bench(
        "serve",
        *("--dataset", str(prompts), "--num-requests", "2", "--rounds", "2", "--ttft-requests", "1"),
        check=False,
    )
    assert result.returncode != 0
    assert "has 5 prompts; this run needs 6" in result.stderr + result.stdout


def test_serve_directly_and_through_the_gateway(tmp_path):
    """Our own server, the offline engine and the same server behind `heteroserve gateway` in one run, their
    throughput over two alternating rounds; then the TTFT comparison with the offline engine over two rounds of
    fresh processes."""
    out = tmp_path / "g.json"
    bench(
        "serve",
        "--gateway",
        "--num-requests",
        "3",
        "--concurrency",
        "3",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--ttft-requests",
        "2",
        "--ttft-rounds",
        "2",
        "--rounds",
        "2",
        "--output-json",
        str(out),
        *SMALL,
    )
    result = json.loads(out.read_text())
    direct = result["heteroserve"]
    offline = result["offline"]["throughput_rounds"]
    assert offline["rounds"] == 2 and offline["rounds_server_output_tokens_per_s"][0] == direct["output_tokens_per_s"]
    assert offline["rounds_offline_output_tokens_per_s"][0] == result["offline"]["output_tokens_per_s"]
    server_s, offline_s = offline["rounds_server_output_tokens_per_s"], offline["rounds_offline_output_tokens_per_s"]
    assert offline["rounds_ratio"] == pytest.approx([s / o for s, o in zip(server_s, offline_s, strict=True)])
    assert result["server_vs_offline_throughput"] == pytest.approx(statistics.median(offline["rounds_ratio"]))
    through = result["via_gateway"]["throughput_rounds"]
    assert through["rounds_gateway_output_tokens_per_s"][0] == result["via_gateway"]["output_tokens_per_s"]
    direct_s, gateway_s = through["rounds_direct_output_tokens_per_s"], through["rounds_gateway_output_tokens_per_s"]
    assert through["rounds_ratio"] == pytest.approx([g / d for d, g in zip(direct_s, gateway_s, strict=True)])
    assert result["gateway_throughput_ratio"] == pytest.approx(statistics.median(through["rounds_ratio"]))
    assert all(x > 0 for x in offline["rounds_ratio"] + through["rounds_ratio"]) and through["rounds"] == 2
    pairs = result["offline"]["paired_ttft"]  # one pair against each of two fresh servers and offline engines
    assert pairs["rounds"] == 2 and pairs["pairs"] == 2
    assert sorted(pairs["overhead_p50_ms_per_round"]) == pytest.approx(sorted(pairs["overhead_samples_ms"]))
    gateway = result["via_gateway"]
    for run in (direct, gateway):
        assert run["errors"] == [] and run["output_tokens"] == 3 * 4
        assert run["concurrency_1"]["requests"] == 2
    assert result["gateway_throughput_ratio"] > 0
    gateway_pairs = gateway["paired_ttft"]  # each request straight and through the gateway, alternating
    assert gateway_pairs["pairs"] == len(gateway_pairs["overhead_samples_ms"]) == 2
    assert result["gateway_ttft_overhead_ms"] == pytest.approx(sum(gateway_pairs["overhead_samples_ms"]) / 2)


def test_embed_against_sentence_transformers(tmp_path):
    """`bench embed` on a small built encoder: both sides' embeddings equal, a ratio per round."""
    out = tmp_path / "embed.json"
    bench(
        "embed", "--passages", "12", "--max-tokens", "64", "--layers", "2", "--rounds", "2",
        "--output-json", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["passages"] == 12 and len(result["ratio_per_round"]) == 2
    assert result["ratio_median"] == pytest.approx(statistics.median(result["ratio_per_round"]))
    assert result["min_cosine_vs_sentence_transformers"] > 0.99999
    assert 12 * 32 <= result["tokens"] <= 12 * 64


def test_serve_passes_every_engine_flag_to_the_server_it_starts():
    """The server `bench serve` starts gets the run's engine settings: parsed back by the server's own parser, they
    equal the bench's (none dropped on the way, as --max-prefill-tokens-per-step once was)."""
    import argparse

    from heteroserve.bench.commands import add_bench_parser
    from heteroserve.bench.serve_command import server_flags
    from heteroserve.engine.engine_args import EngineArgs
    from heteroserve.entrypoints.openai.server_args import make_parser

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    given = [
        *("--max-model-len", "512", "--max-prefill-tokens-per-step", "512", "--no-enable-prefix-caching"),
        *("--enable-lora", "--max-loras", "3", "--quantization", "none", "--limit-mm-per-prompt", "image=2"),
        *("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--kv-cache-dtype", "bfloat16"),
    ]
    bench_args = parser.parse_args(["bench", "serve", *given])
    server_args = make_parser().parse_args(server_flags(bench_args))
    assert EngineArgs.from_cli_args(server_args, None) == EngineArgs.from_cli_args(bench_args, None)
    assert EngineArgs.from_cli_args(bench_args, None) != EngineArgs()


# Runs `heteroserve bench ARGV`, imports the module of every user-facing bench command, then prints which peer
# harnesses (heteroserve.bench.peers.*) and peer runtimes the process loaded.
PEER_PROBE = """
import importlib, json, sys
from heteroserve.entrypoints.cli import main
main(sys.argv[1:])
for command in ("latency_command", "throughput_command", "serve_command", "soak"):
    importlib.import_module(f"heteroserve.bench.{command}")
runtimes = ("llama_cpp", "vllm", "sentence_transformers")
print(json.dumps(sorted(m for m in sys.modules if m.startswith("heteroserve.bench.peers.") or m in runtimes)))
"""


def test_our_engine_alone_loads_no_peer_harness(tmp_path):
    """The peers' harnesses are imported when a run names one (--peer), never for our engine alone."""
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", "--input-len", "8", "--output-len", "2", "--repeats", "1", "--output-json", str(out)]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run(
        [sys.executable, "-c", PEER_PROBE, *argv, *SMALL], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout.splitlines()[-1]) == []
    assert json.loads(out.read_text())["peers"] == {}
