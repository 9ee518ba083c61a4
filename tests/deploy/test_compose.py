"""compose.yaml: the gateway's file loads with the gateway's own loader and points at the servers' real
ports (their args parsed by the server's parser), Prometheus scrapes every heteroserve service, and Grafana
is provisioned with the shipped dashboard."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from heteroserve.entrypoints.gateway.config import load_config
from heteroserve.entrypoints.openai.server_args import make_parser

ROOT = Path(__file__).parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]


def mounts(service: dict) -> dict[str, Path]:
    """Container path -> host path (relative to the repository) of a service's bind mounts."""
    pairs = (volume.split(":")[:2] for volume in service.get("volumes", []))
    return {container: (ROOT / host).resolve() for host, container in pairs}


def listen_port(service: dict) -> int:
    command = service["command"]
    return int(command[command.index("--port") + 1])


def heteroserve_services() -> dict[str, dict]:
    return {name: s for name, s in SERVICES.items() if s["image"].startswith("heteroserve:")}


def test_servers_parse_and_gateway_routes_to_them():
    servers = {name: s for name, s in heteroserve_services().items() if s["command"][0] == "serve"}
    assert len(servers) >= 2
    for server in servers.values():
        args = make_parser().parse_args(server["command"][1:])
        assert server["environment"]["HEALTHCHECK_PORT"] == str(args.port)  # the image's HEALTHCHECK port
    gateway = SERVICES["gateway"]
    assert gateway["ports"] == ["8000:8000"] and listen_port(gateway) == 8000
    command = gateway["command"]
    config = load_config(mounts(gateway)[command[command.index("--config") + 1]])
    targets = {(urlparse(b.url).hostname, urlparse(b.url).port) for b in config.backends}
    assert targets == {(name, listen_port(s)) for name, s in servers.items()}
    assert set(gateway["depends_on"]) == set(servers)


def test_prometheus_scrapes_every_heteroserve_service():
    prometheus = SERVICES["prometheus"]
    scrape = yaml.safe_load(mounts(prometheus)["/etc/prometheus/prometheus.yml"].read_text())
    targets = {t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    assert targets == {f"{name}:{listen_port(s)}" for name, s in heteroserve_services().items()}


def test_grafana_is_provisioned_with_the_dashboard():
    grafana = SERVICES["grafana"]
    volumes = mounts(grafana)
    provisioning = volumes["/etc/grafana/provisioning"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "heteroserve.yaml").read_text())["providers"]
    assert volumes[provider["options"]["path"]] == (ROOT / "deploy" / "grafana").resolve()
    assert (ROOT / "deploy" / "grafana" / "heteroserve-dashboard.json").exists()
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus"
    assert urlparse(source["url"]).hostname == "prometheus" and urlparse(source["url"]).port == 9090


def test_prometheus_config_passes_promtool():
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    path = ROOT / "deploy" / "compose" / "prometheus.yml"
    result = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
