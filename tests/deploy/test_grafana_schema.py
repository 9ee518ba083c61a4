"""The dashboard type-checks against Grafana's own dashboard types (npm @grafana/schema, generated from
Grafana's schema): unknown keys, wrong value types and unknown variable or panel fields are errors.
No Grafana server can be installed here (docs/DEPLOYMENT.md), so this stands in for loading it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "heteroserve-dashboard.json"
CHECK = ROOT / "deploy" / "grafana" / "schema-check"
TSC = CHECK / "node_modules" / "typescript" / "bin" / "tsc"


def type_check(dashboard: dict) -> subprocess.CompletedProcess:
    source = CHECK / f".dashboard-{os.getpid()}.ts"  # beside node_modules, so the import resolves
    source.write_text(
        'import type { Dashboard } from "@grafana/schema";\n'
        f"export const dashboard: Dashboard = {json.dumps(dashboard, indent=1)};\n"
    )
    try:
        flags = ["--noEmit", "--strict", "--module", "esnext", "--moduleResolution", "bundler", "--skipLibCheck"]
        return subprocess.run(["node", str(TSC), *flags, source.name], cwd=CHECK, capture_output=True, text=True)
    finally:
        source.unlink()


@pytest.fixture(scope="module", autouse=True)
def typescript():
    if shutil.which("node") is None or not TSC.exists():
        pytest.skip(f"node or {CHECK}/node_modules missing (npm ci --prefix {CHECK.relative_to(ROOT)})")


def test_dashboard_matches_grafana_types():
    result = type_check(json.loads(DASHBOARD.read_text()))
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_broken_dashboard_is_refused():
    """The check has teeth: a misspelt panel field and a string where Grafana wants a number fail."""
    dashboard = json.loads(DASHBOARD.read_text())
    dashboard["panels"][0]["titel"] = dashboard["panels"][0].pop("title")
    dashboard["panels"][1]["gridPos"]["w"] = "12"
    result = type_check(dashboard)
    assert result.returncode != 0
    assert "titel" in result.stdout and "not assignable to type 'number'" in result.stdout
