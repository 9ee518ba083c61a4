"""deploy/k8s: built-in kinds against the Kubernetes schemas bundled in kubernetes-validate (offline), custom
resources and cross-references checked structurally, container args parsed by our own CLI parsers, and the
gateway's ConfigMap loaded by the gateway's config loader."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import httpx
import kubernetes_validate
import pytest
import yaml

from heteroserve.entrypoints.gateway import add_gateway_args
from heteroserve.entrypoints.gateway.config import load_config
from heteroserve.entrypoints.openai.server_args import make_parser
from heteroserve.model.loader.source import DEFAULT_MODEL_NAME

K8S = Path(__file__).parents[2] / "deploy" / "k8s"
FILES = sorted(K8S.rglob("*.yaml"))
DOCS = [(path, doc) for path in FILES for doc in yaml.safe_load_all(path.read_text()) if doc]
CUSTOM_KINDS = {"ServiceMonitor"}
# --device -> the extended resource its vendor's device plugin advertises (docs/DEPLOYMENT.md).
DEVICE_RESOURCES = {
    "cuda": "nvidia.com/gpu",
    "npu": "huawei.com/Ascend910",
    "mlu": "cambricon.com/mlu",
    "rocm": "hygon.com/dcu",
    "cpu": None,
}
UVICORN_SHUTDOWN_S = 5  # api_server.py runs uvicorn with timeout_graceful_shutdown=5 after the drain


def of_kind(kind: str) -> list[dict]:
    return [doc for _, doc in DOCS if doc["kind"] == kind]


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def server_args(deployment: dict) -> argparse.Namespace:
    args = container(deployment)["args"]
    assert args[0] == "serve", args
    return make_parser().parse_args(args[1:])


SERVERS = [d for d in of_kind("Deployment") if container(d)["args"][0] == "serve"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


BUILTIN = [
    pytest.param(doc, id=f"{path.relative_to(K8S)}:{doc['kind']}/{doc['metadata']['name']}")
    for path, doc in DOCS
    if doc["kind"] not in CUSTOM_KINDS
]


@pytest.mark.parametrize("version", ["1.30.0", kubernetes_validate.latest_version()])
@pytest.mark.parametrize("doc", BUILTIN)
def test_builtin_kinds_match_the_kubernetes_schema(doc, version):
    kubernetes_validate.validate(doc, version, strict=True)


def test_every_server_pool_is_complete():
    assert {server_args(d).device for d in SERVERS} == set(DEVICE_RESOURCES)
    for deployment in SERVERS:
        name = deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]
        spec, main = pod["spec"], container(deployment)
        assert selects(deployment["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
        assert main["livenessProbe"]["httpGet"]["path"] == "/health", name
        assert main["readinessProbe"]["httpGet"]["path"] == "/health/ready", name
        assert main["startupProbe"]["httpGet"]["path"] == "/health", name
        assert spec["securityContext"]["runAsNonRoot"] and main["securityContext"]["readOnlyRootFilesystem"]
        # The pod is killed only after the preStop pause, the server's drain and uvicorn's shutdown.
        args = server_args(deployment)
        needed = main["lifecycle"]["preStop"]["sleep"]["seconds"] + args.drain_timeout + UVICORN_SHUTDOWN_S
        assert spec["terminationGracePeriodSeconds"] >= needed, name
        assert args.port == main["ports"][0]["containerPort"]
        resource = DEVICE_RESOURCES[args.device]
        requests, limits = main["resources"]["requests"], main["resources"]["limits"]
        if resource is None:
            assert not [r for r in requests if "/" in r], f"{name} asks for a device with --device cpu"
        else:  # extended resources: request must equal limit
            assert requests[resource] == limits[resource] == "1", name
        pool = pod["metadata"]["labels"]["heteroserve.io/pool"]
        assert spec["nodeSelector"]["heteroserve.io/pool"] == pool
        for kind in ("Service", "PodDisruptionBudget"):
            selectors = [d["spec"]["selector"] for d in of_kind(kind)]
            selectors = [s.get("matchLabels", s) for s in selectors]
            assert any(selects(s, pod["metadata"]["labels"]) for s in selectors), f"no {kind} for {name}"


def test_arm_edge_pool_runs_on_arm64():
    (edge,) = [d for d in SERVERS if d["spec"]["template"]["metadata"]["labels"]["heteroserve.io/pool"] == "edge"]
    assert edge["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.io/arch"] == "arm64"


def test_gateway_configmap_loads_and_routes_to_the_pools(tmp_path):
    (configmap,) = [c for c in of_kind("ConfigMap") if c["metadata"]["name"] == "heteroserve-gateway"]
    (gateway,) = [d for d in of_kind("Deployment") if container(d)["args"][0] == "gateway"]
    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    args = parser.parse_args(container(gateway)["args"][1:])
    # The gateway drains as a server does: killed only after the preStop pause, its drain and uvicorn's shutdown.
    pause = container(gateway)["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= pause + args.drain_timeout + UVICORN_SHUTDOWN_S
    mount = next(m for m in container(gateway)["volumeMounts"] if m["name"] == "config")
    (volume,) = [v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    file_name = Path(args.config).name
    assert Path(args.config).parent == Path(mount["mountPath"])
    (tmp_path / file_name).write_text(configmap["data"][file_name])
    config = load_config(tmp_path / file_name)  # the gateway's own loader and validation

    services = {(s["metadata"]["name"], s["metadata"]["namespace"]): s for s in of_kind("Service")}
    pools = set()
    for backend in config.backends:
        match = re.fullmatch(r"http://([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local:(\d+)", backend.url)
        assert match, backend.url
        service = services[(match[1], match[2])]
        assert int(match[3]) in [p["port"] for p in service["spec"]["ports"]]
        (deployment,) = [
            d for d in SERVERS if selects(service["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
        ]
        pool = deployment["spec"]["template"]["spec"]["nodeSelector"]["heteroserve.io/pool"]
        assert backend.labels["pool"] == pool
        pools.add(pool)
        assert DEFAULT_MODEL_NAME in backend.models
    assert pools == {"gpu", "npu", "edge"}


def test_service_monitor_scrapes_every_service():
    (monitor,) = of_kind("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    spec = monitor["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels"}
    for service in of_kind("Service"):
        assert selects(spec["selector"]["matchLabels"], service["metadata"]["labels"]), service["metadata"]["name"]
        assert service["metadata"]["namespace"] in spec["namespaceSelector"]["matchNames"]
        for endpoint in spec["endpoints"]:
            assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]
            assert endpoint["path"] == "/metrics"


def test_hpa_metric_is_served_by_the_adapter_from_a_real_server_metric(server):
    (hpa,) = of_kind("HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert target["name"] in [d["metadata"]["name"] for d in SERVERS]
    (adapter,) = [c for c in of_kind("ConfigMap") if c["metadata"]["name"] == "adapter-config"]
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    exported = httpx.get(f"{server.base_url}/metrics").text
    served = set()
    for rule in rules:
        (series,) = re.findall(r"^([a-z_:][a-z0-9_:]*)\{", rule["seriesQuery"])
        assert re.search(rf"^{re.escape(series)}[{{ ]", exported, re.M), f"the server does not export {series}"
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
        as_name = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
        assert re.fullmatch(r"[a-z0-9_]+", as_name), as_name  # custom metric names cannot hold ':'
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
        served.add(as_name)
    for metric in hpa["spec"]["metrics"]:
        assert metric["type"] == "Pods"
        assert metric["pods"]["metric"]["name"] in served
