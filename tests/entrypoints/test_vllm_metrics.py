"""Issue #28: /metrics carries vLLM's metric names (vllm:*) beside ours, the histograms vLLM users chart, the cache
configuration, aborts by reason and the process's figures; each one moves under a few requests, and the queries
vLLM's example Grafana dashboard runs return series in a real Prometheus."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest

from heteroserve.metrics.prometheus import BucketCounts, buckets_1_2_5
from tests.entrypoints.server_process import ChildServer, ServerProcess, free_port

MODEL = "SmolLM2-135M-Instruct"
# Counters and histogram counts that a few finished requests move (the names after the prefix).
MOVING = [
    "prompt_tokens_total",
    "generation_tokens_total",
    "request_success_total",
    "prefix_cache_queries_total",
    "time_to_first_token_seconds_count",
    "time_per_output_token_seconds_count",
    "inter_token_latency_seconds_count",
    "e2e_request_latency_seconds_count",
    "request_queue_time_seconds_count",
    "request_prefill_time_seconds_count",
    "request_decode_time_seconds_count",
    "request_inference_time_seconds_count",
    "request_prompt_tokens_count",
    "request_generation_tokens_count",
    "iteration_tokens_total_count",
    "request_params_max_tokens_count",
    "request_params_n_count",
]
PRESENT = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total"]
PROCESS = ["process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"]
# The series vLLM's example Grafana dashboard (examples/online_serving/prometheus_grafana) and its routers read.
VLLM_DASHBOARD_QUERIES = [
    "histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket[1m])))",
    "rate(vllm:prompt_tokens_total[1m])",
    "rate(vllm:generation_tokens_total[1m])",
    "histogram_quantile(0.9, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket[1m])))",
    "histogram_quantile(0.9, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket[1m])))",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:gpu_cache_usage_perc",
    "vllm:kv_cache_usage_perc",
    "sum by(le) (increase(vllm:request_prompt_tokens_bucket[1m]))",
    "sum by(le) (increase(vllm:request_generation_tokens_bucket[1m]))",
    "sum by(finished_reason) (increase(vllm:request_success_total[1m]))",
    "histogram_quantile(0.9, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket[1m])))",
    "rate(vllm:request_queue_time_seconds_sum[1m])",
    "rate(vllm:request_prefill_time_seconds_sum[1m])",
    "rate(vllm:request_decode_time_seconds_sum[1m])",
    "rate(vllm:request_inference_time_seconds_sum[1m])",
    "sum by(le) (increase(vllm:iteration_tokens_total_bucket[1m]))",
    "sum by(le) (increase(vllm:request_params_max_tokens_bucket[1m]))",
    "sum by(le) (increase(vllm:request_params_n_bucket[1m]))",
    "vllm:cache_config_info",
    "rate(vllm:prefix_cache_hits_total[1m]) / rate(vllm:prefix_cache_queries_total[1m])",
]


def scrape(server) -> dict[str, float]:
    """Every sample name in /metrics -> the sum of its samples."""
    totals: dict[str, float] = {}
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def _load(server) -> None:
    """A few requests: a JSON completion with n = 2 and a streamed chat."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "n": 2, "ignore_eos": True}
    httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).raise_for_status()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=chat, timeout=120) as response:
        assert response.status_code == 200
        assert "data: [DONE]" in list(response.iter_lines())


def _wait_for(server, name: str, above: float, seconds: float = 15) -> float:
    deadline = time.monotonic() + seconds
    while True:
        value = scrape(server).get(name, 0.0)
        if value > above or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_buckets_follow_vllms():
    assert buckets_1_2_5(512) == (1, 2, 5, 10, 20, 50, 100, 200, 500)
    counts = BucketCounts((1, 8, 16))
    counts.observe(8, 3)
    counts.observe(40, 1)
    family = counts.family("x", "doc", {"model_name": "m"})
    buckets = {s.labels["le"]: s.value for s in family.samples if s.name == "x_bucket"}
    assert buckets == {"1.0": 0, "8.0": 3, "16.0": 3, "+Inf": 4}
    assert {s.name: s.value for s in family.samples if s.name != "x_bucket"} == {"x_count": 4, "x_sum": 64}


def test_every_metric_under_both_prefixes_moves_under_load(server):
    before = scrape(server)
    _load(server)
    after = scrape(server)
    for prefix in ("heteroserve:", "vllm:"):
        for name in MOVING:
            assert after.get(prefix + name, 0) > before.get(prefix + name, 0), prefix + name
        for name in PRESENT:
            assert prefix + name in after, prefix + name
        for reason in ("client_disconnect", "timeout", "engine_error", "grammar_error"):
            text = httpx.get(f"{server.base_url}/metrics").text
            assert f'{prefix}request_aborted_total{{model_name="{MODEL}",reason="{reason}"}}' in text
        assert after[prefix + "cache_config_info"] == 1
        # n = 2 and max_tokens 6 from the completion, n = 1 and max_tokens 5 from the chat.
        assert after[prefix + "request_params_n_sum"] - before.get(prefix + "request_params_n_sum", 0) == 3
        assert (
            after[prefix + "request_params_max_tokens_sum"] - before.get(prefix + "request_params_max_tokens_sum", 0)
            == 11
        )
        # Three finished sequences: 12 tokens from the completion, 5 from the chat (it may stop early).
        generated = after[prefix + "request_generation_tokens_sum"] - before.get(
            prefix + "request_generation_tokens_sum", 0
        )
        assert 13 <= generated <= 17
        # One step gives each of these (greedy, undrafted) sequences one token: a gap per token after the first.
        gaps = after[prefix + "inter_token_latency_seconds_count"] - before.get(
            prefix + "inter_token_latency_seconds_count", 0
        )
        assert gaps == generated - 3
    assert "vllm:gpu_cache_usage_perc" in after and "heteroserve:gpu_cache_usage_perc" not in after
    for name in PROCESS:
        assert after.get(name, 0) > 0, name
    text = httpx.get(f"{server.base_url}/metrics").text
    assert 'block_size="16"' in text and 'enable_prefix_caching="True"' in text


def test_client_disconnect_counts_as_abort(server):
    name = "vllm:request_aborted_total"
    before = scrape(server)
    reason = 'reason="client_disconnect"'
    counted = server.metric(name, reason="client_disconnect")
    body = {"model": MODEL, "prompt": "Write a very long essay.", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i > 4:
                break
    deadline = time.monotonic() + 15
    while server.metric(name, reason="client_disconnect") == counted and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.metric(name, reason="client_disconnect") == counted + 1, reason
    # A JSON answer the client gave up on (a read timeout) is an abort too.
    body = {"model": MODEL, "prompt": "Write a very long essay.", "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=1.0))
    deadline = time.monotonic() + 15
    while server.metric(name, reason="client_disconnect") == counted + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.metric(name, reason="client_disconnect") == counted + 2
    assert server.metric("heteroserve:request_aborted_total", reason="client_disconnect") == counted + 2
    after = scrape(server)
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == 2  # as finished_reason abort


@pytest.fixture(scope="module")
def vllm_only_server():
    """A server with a 1 s request timeout that exports only vLLM's names."""
    process = ServerProcess(
        "--max-model-len", "512", "--kv-cache-memory-bytes", str(128 * 1024**2), "--quantization", "none",
        "--request-timeout", "1", "--metrics-prefix", "vllm",
    )  # fmt: skip
    yield process
    process.stop()


def test_request_timeout_counts_as_abort_and_prefix_vllm_only(vllm_only_server):
    server = vllm_only_server
    body = {"model": MODEL, "prompt": "Write a very long essay.", "max_tokens": 480, "ignore_eos": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 408
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as streamed:
        lines = [line for line in streamed.iter_lines() if line]
    assert "did not finish within" in lines[-2]
    assert _wait_for(server, "vllm:request_aborted_total", 1.5) == 2
    assert server.metric("vllm:request_aborted_total", reason="timeout") == 2
    totals = scrape(server)
    assert not [name for name in totals if name.startswith("heteroserve:")]
    assert totals["vllm:num_requests_running"] == 0 and totals["process_open_fds"] > 0


def test_vllm_dashboard_queries_run_in_a_real_prometheus(server, tmp_path):
    """Prometheus scrapes the live server; each query vLLM's dashboard makes parses and returns series."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (Debian: apt-get install prometheus; scripts/setup.sh does it)")
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {"job_name": "heteroserve", "static_configs": [{"targets": [server.base_url.removeprefix("http://")]}]}
        ],
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))
    port = free_port()
    command = [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}"]
    command += [f"--web.listen-address=127.0.0.1:{port}"]
    prometheus = ChildServer(command, port, "prometheus", ready_path="/-/ready", startup_timeout=60)
    api = f"{prometheus.base_url}/api/v1/query"
    try:
        deadline = time.monotonic() + 30
        while not httpx.get(api, params={"query": "up == 1"}).json()["data"]["result"]:
            assert time.monotonic() < deadline, "Prometheus did not scrape the server"
            time.sleep(0.5)
        time.sleep(1.5)
        _load(server)
        time.sleep(3)  # scrapes after the traffic, so rates and quantiles have data
        for query in VLLM_DASHBOARD_QUERIES:
            answer = httpx.get(api, params={"query": query}).json()
            assert answer["status"] == "success", f"{query}: {answer}"
            assert answer["data"]["result"], f"{query} returned no series"
    finally:
        prometheus.stop()
