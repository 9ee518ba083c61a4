"""Config validation (errors name the bad field), routing and balancing rules, the breaker: no processes
except one gateway started on a bad file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from heteroserve.entrypoints.gateway.config import ConfigError, load_config
from heteroserve.entrypoints.gateway.router import Router

EXAMPLE = Path(__file__).parents[2] / "deploy" / "gateway.example.yaml"


def base() -> dict:
    return {
        "backends": [
            {"name": "a", "url": "http://127.0.0.1:1", "models": ["m"], "labels": {"pool": "gpu"}, "weight": 2},
            {"name": "b", "url": "http://127.0.0.1:2", "models": ["m", "n"], "labels": {"pool": "npu"}},
        ],
        "routes": [{"model": "m", "aliases": ["alias"], "service_class": "batch", "selector": {"pool": "npu"}}],
    }


def load(tmp_path: Path, config: dict):
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    return load_config(path)


def test_example_config_is_valid():
    config = load_config(EXAMPLE)
    assert [b.name for b in config.backends] == ["gpu-0", "npu-0", "edge-0"]


def _broken(change) -> dict:
    config = base()
    change(config)
    return config


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["backends"][0].update(weight=0), "backends.0.weight: Input should be greater than 0"),
        (lambda c: c["backends"][0].update(wieght=2), "backends.0.wieght: Extra inputs are not permitted"),
        (lambda c: c["backends"][1].update(url="127.0.0.1:2"), "backends.1.url: String should match pattern"),
        (lambda c: c["backends"][1].update(models=[]), "backends.1.models: List should have at least 1 item"),
        (lambda c: c["backends"][1].update(name="a"), "backend names must be unique"),
        (lambda c: c["routes"][0].update(selector={"pool": "tpu"}), "routes.0.selector: {'pool': 'tpu'} matches no"),
        (lambda c: c["routes"][0].update(backends=["c"]), "routes.0.backends: no backend named 'c'"),
        (lambda c: c["routes"][0].update(model="n", selector={}, backends=["a"]), "routes.0.model: backend 'a' does"),
        (lambda c: c["routes"][0].update(selector={}), "routes.0: give backends or selector"),
        (lambda c: c["routes"].append(dict(c["routes"][0])), "routes.1: 'm' is routed twice"),
        (lambda c: c.update(max_attempts=0), "max_attempts: Input should be greater than or equal to 1"),
        (lambda c: c.update(health={"interval": "often"}), "health.interval: Input should be a valid number"),
        (lambda c: c.update(backends=[]), "backends: List should have at least 1 item"),
    ],
)
def test_config_errors_name_the_field(tmp_path, change, message):
    with pytest.raises(ConfigError) as error:
        load(tmp_path, _broken(change))
    assert str(error.value).startswith(str(tmp_path / "gateway.yaml") + ": ")
    assert message in str(error.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="No such file"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("backends: [")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(tmp_path / "bad.yaml")


def test_cli_refuses_a_bad_config(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(_broken(lambda c: c["backends"][0].update(weight=-1))))
    command = [sys.executable, "-m", "heteroserve.entrypoints.cli", "gateway", "--config", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "invalid gateway config" in done.stderr and "backends.0.weight" in done.stderr


def test_routes_classes_and_aliases(tmp_path):
    router = Router(load(tmp_path, base()))
    assert router.model_names() == ["alias", "m", "n"]
    assert [b.name for b in router.resolve("m", None).backends] == ["a", "b"]  # no route: all serving m
    assert [b.name for b in router.resolve("m", "other").backends] == ["a", "b"]
    batch = router.resolve("alias", "batch")
    assert batch.model == "m" and [b.name for b in batch.backends] == ["b"]
    assert router.resolve("alias", None) is None and router.resolve("x", None) is None


def test_weighted_fewest_outstanding(tmp_path):
    router = Router(load(tmp_path, base()))
    target = router.resolve("m", None)
    b = router.backends["b"]
    picks = []
    for _ in range(6):
        chosen = Router.pick(target, set())
        chosen.outstanding += 1
        picks.append(chosen.name)
    assert picks.count("a") == 4 and picks.count("b") == 2  # a has weight 2
    assert Router.pick(target, {"a"}) is b
    b.open("test")
    assert Router.pick(target, {"a"}) is None


def test_breaker_opens_after_threshold_and_reload_keeps_state(tmp_path):
    config = base()
    config["health"] = {"failure_threshold": 2}
    router = Router(load(tmp_path, config))
    a = router.backends["a"]
    a.record_5xx()
    assert a.up
    a.record_success()
    a.record_5xx()
    assert a.up
    a.record_5xx()
    assert not a.up
    a.outstanding = 3
    reloaded = Router(load(tmp_path, base()), router.backends)
    assert reloaded.backends["a"] is a and a.outstanding == 3 and not a.up
