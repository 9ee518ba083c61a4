"""`heteroserve env`, run as a command, with and without the example plugin installed."""

from __future__ import annotations

import json

from tests.platforms.plugin_site import run_python

ENV = ["-m", "heteroserve.entrypoints.cli", "env"]


def test_env_reports_platforms_isa_and_kernels():
    result = run_python(ENV)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for name in ("cuda", "rocm", "npu", "mlu", "xpu", "mps", "cpu"):
        assert f"\n  {name} " in out
    assert "chosen: cpu" in out and "torch:" in out and "host memory:" in out
    assert "torch_npu:" in out and "ISA" in out
    assert "rms_norm" in out and "decode_attention" in out and "linear" in out


def test_env_json_with_a_plugin_platform(plugin_site):
    result = run_python([*ENV, "--json", "--device", "partial"], plugin_site)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    platforms = {p["name"]: p for p in report["platforms"]}
    assert platforms["partial"]["source"] == "plugin heteroserve-counting-platform"
    assert platforms["absent"]["available"] is False
    assert report["extensions"]["heteroserve-counting-platform"] == "0.1"
    chosen = report["chosen"]
    assert chosen["platform"] == "partial"
    assert chosen["operators"]["rms_norm"] == "cpu fallback"
    assert chosen["operators"]["rotary"] == "counting.rotary"
    assert isinstance(report["cpu"]["isa"], list)


def test_env_with_an_unavailable_device_says_why():
    result = run_python([*ENV, "--device", "npu"])
    assert result.returncode == 0, result.stderr
    assert "chosen: none: device 'npu' is not available here" in result.stdout
