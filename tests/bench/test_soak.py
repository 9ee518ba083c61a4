"""`heteroserve bench soak` for under a minute of traffic: the gateway and two servers (real processes on
127.0.0.1) under mixed traffic while one back end is killed and restarted, another stopped past the health
timeout, the gateway reloaded and a back end drained. Nothing may be lost."""

from __future__ import annotations

import json

from tests.bench.test_bench_commands import bench


def test_a_short_soak_loses_nothing(tmp_path):
    out = tmp_path / "soak.json"
    result = bench("soak", "--duration", "40", "--concurrency", "4", "--output-json", str(out), check=False)
    report = json.loads(out.read_text())
    requests = report["requests"]
    assert requests["failed_before_first_byte"] == 0, requests
    assert requests["streams_broken_without_error_event"] == 0, requests
    assert requests["unexpected_5xx"] == 0 and requests["unexpected_status"] == [], requests
    assert requests["answered"] > 10 and requests["rejected_as_expected"] > 0 and requests["cancelled_by_client"] > 0
    assert set(report["kv_cache_usage_after_load"].values()) == {0.0}
    assert set(report["requests_running_after_load"].values()) == {0.0}
    events = [e["event"] for e in report["faults"]]
    assert events == ["SIGKILL", "restarted", "SIGSTOP", "SIGCONT", "SIGHUP", "SIGTERM", "exited", "restarted"]
    assert next(e for e in report["faults"] if e["event"] == "exited")["code"] == 0  # the drain exits cleanly
    assert report["rss"]["server-1"]["growth"] is not None
    assert result.returncode == 0, result.stderr[-2000:]
