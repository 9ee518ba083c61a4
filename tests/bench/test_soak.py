"""`heteroserve bench soak` for under a minute of traffic: the gateway and two servers (real processes on
127.0.0.1) under mixed traffic while one back end is killed and restarted, another stopped past the health
timeout, the gateway reloaded and a back end drained. Nothing may be lost."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys

import pytest

from heteroserve.bench import soak
from heteroserve.bench.soak import drain, soak_failures
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


# Stand-ins for a drained back end: one that ignores SIGTERM (as a server whose drain hangs), one that exits 0 on it.
_STAND_IN = "import signal, sys, time; signal.signal(signal.SIGTERM, {}); print('ready', flush=True); time.sleep(60)"
IGNORES_SIGTERM = _STAND_IN.format("signal.SIG_IGN")
EXITS_ON_SIGTERM = _STAND_IN.format("lambda *_: sys.exit(0)")


def _stand_in(code: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ready\n"  # its signal handling is in place
    return process


def test_a_back_end_that_does_not_exit_after_its_drain_fails_the_soak(tmp_path, monkeypatch):
    """A drained back end still running when the wait ends is killed, recorded as such, and fails the soak with
    a non-zero exit naming it (the soak recorded code null and exited 0); one that exits 0 passes."""
    stubborn = _stand_in(IGNORES_SIGTERM)
    ended = drain(stubborn, "server-0", exit_within_s=1)
    assert ended == {"event": "did not exit after drain", "backend": "server-0", "waited_s": 1}
    assert stubborn.returncode == -signal.SIGKILL
    exited = {"event": "exited", "backend": "server-0", "code": 0}
    assert drain(_stand_in(EXITS_ON_SIGTERM), "server-0", exit_within_s=10) == exited

    clean = {
        "requests": {"failed_before_first_byte": 0, "streams_broken_without_error_event": 0, "unexpected_5xx": 0},
        "kv_cache_usage_after_load": {"server-0": 0.0, "server-1": 0.0},
        "faults": [{"event": "SIGTERM", "backend": "server-0"}, exited],
    }
    assert soak_failures(clean) == []
    hung = {**clean, "faults": [{"event": "SIGTERM", "backend": "server-0"}, ended]}
    monkeypatch.setattr(soak, "run_soak", lambda args: dict(hung))
    out = tmp_path / "soak.json"
    with pytest.raises(SystemExit) as command:
        soak.run_soak_command(argparse.Namespace(servers=2, duration=40, output_json=out))
    assert command.value.code == 1
    assert json.loads(out.read_text())["failures"] == ["server-0 did not exit within 1 s of SIGTERM (drain)"]
