"""Every query of the shipped Grafana dashboard names metrics that a live server or a live gateway really
exports, and the dashboard covers what operators watch."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.server_process import ChildServer, free_port
from tests.gateway.processes import GatewayProcess

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "heteroserve-dashboard.json"
# What the dashboard must show (issue #9): the metric each topic needs.
REQUIRED = {
    "requests running": "heteroserve:num_requests_running",
    "requests waiting": "heteroserve:num_requests_waiting",
    "KV cache usage": "heteroserve:kv_cache_usage_perc",
    "prefix-cache hit rate": "heteroserve:prefix_cache_hits_total",
    "TTFT percentiles": "heteroserve:time_to_first_token_seconds_bucket",
    "TPOT percentiles": "heteroserve:time_per_output_token_seconds_bucket",
    "end-to-end percentiles": "heteroserve:e2e_request_latency_seconds_bucket",
    "throughput": "heteroserve:generation_tokens_total",
    "preemptions": "heteroserve:num_preemptions_total",
    "fallback operators": "heteroserve:operator_fallbacks_total",
    "weights on the reference product": "heteroserve:linear_reference_calls_total",
    "gateway back-end health": "heteroserve:gateway_backend_up",
    "gateway errors per back end": "heteroserve:gateway_errors_total",
}
_SUFFIXES = {"counter": ["_total", "_created"], "histogram": ["_bucket", "_sum", "_count", "_created"]}


def exported_names(metrics_text: str) -> set[str]:
    """Every series name a scrape can hold, including labelled families with no samples yet."""
    names = set()
    for family in text_string_to_metric_families(metrics_text):
        names.add(family.name)
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, []))
        names.update(sample.name for sample in family.samples)
    return names


def queried_names(dashboard: dict) -> dict[str, list[str]]:
    """Panel title -> the metric names its queries use."""
    queries = {}
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        names = []
        for target in panel["targets"]:
            found = re.findall(r"heteroserve:[a-z0-9_]+", target["expr"])
            assert found, target["expr"]
            names += found
        queries[panel["title"]] = names
    return queries


@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory):
    """A gateway in front of the session server, with one chat request through it."""
    config = {"backends": [{"name": "server", "url": server.base_url, "models": ["SmolLM2-135M-Instruct"]}]}
    process = GatewayProcess(config, tmp_path_factory.mktemp("dashboard-gateway"))
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    httpx.post(f"{process.base_url}/v1/chat/completions", json=body, timeout=120).raise_for_status()
    yield process
    process.stop()


def test_dashboard_queries_use_exported_metrics(server, gateway):
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_names(httpx.get(f"{server.base_url}/metrics").text)
    exported_by_gateway = exported_names(httpx.get(f"{gateway.base_url}/metrics").text)
    assert "heteroserve:gateway_requests_total" in exported_by_gateway
    for title, names in queried_names(dashboard).items():
        for name in names:
            source = exported_by_gateway if name.startswith("heteroserve:gateway_") else exported
            assert name in source, f"panel {title!r} queries {name}, which nothing exports"


def test_dashboard_covers_what_operators_watch():
    dashboard = json.loads(DASHBOARD.read_text())
    used = {name for names in queried_names(dashboard).values() for name in names}
    missing = [topic for topic, name in REQUIRED.items() if name not in used]
    assert not missing, f"the dashboard has no panel for {missing}"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_queries_run_in_a_real_prometheus(server, gateway, tmp_path):
    """Prometheus scrapes the live server and gateway; every panel query parses and, but for counters that
    only appear after an error or a retry, returns series."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (Debian: apt-get install prometheus; scripts/setup.sh does it)")
    targets = [server.base_url.removeprefix("http://"), gateway.base_url.removeprefix("http://")]
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "heteroserve", "static_configs": [{"targets": targets}]}],
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))
    port = free_port()
    command = [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}"]
    command += [f"--web.listen-address=127.0.0.1:{port}"]
    prometheus = ChildServer(command, port, "prometheus", ready_path="/-/ready", startup_timeout=60)
    api = f"{prometheus.base_url}/api/v1/query"
    try:
        _wait_for_scrapes(api, len(targets))
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        for _ in range(3):
            httpx.post(f"{gateway.base_url}/v1/chat/completions", json=body, timeout=120).raise_for_status()
        time.sleep(3)  # scrapes after the traffic, so rates and histogram quantiles have data
        dashboard = json.loads(DASHBOARD.read_text())
        empty = []
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$model_name", ".*")
                answer = httpx.get(api, params={"query": expr}).json()
                assert answer["status"] == "success", f"{panel['title']!r}: {expr}: {answer}"
                if not answer["data"]["result"]:
                    empty += re.findall(r"heteroserve:[a-z0-9_]+", expr)
        assert set(empty) <= {"heteroserve:gateway_errors_total", "heteroserve:gateway_retries_total"}, empty
    finally:
        prometheus.stop()


def _wait_for_scrapes(api: str, targets: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        result = httpx.get(api, params={"query": "up == 1"}).json()["data"]["result"]
        if len(result) == targets:
            return
        time.sleep(0.5)
    raise TimeoutError("Prometheus did not scrape both targets")
