"""Every query of the shipped Grafana dashboard names metrics that a live server really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "heteroserve-dashboard.json"


def test_dashboard_queries_use_exported_metrics(server):
    dashboard = json.loads(DASHBOARD.read_text())
    exported = {
        line.split("{")[0].split(" ")[0]
        for line in httpx.get(f"{server.base_url}/metrics").text.splitlines()
        if line and not line.startswith("#")
    }
    assert dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = re.findall(r"heteroserve:[a-z0-9_]+", target["expr"])
            assert names, target["expr"]
            for name in names:
                assert name in exported, f"panel {panel['title']!r} queries {name}, which the server does not export"
