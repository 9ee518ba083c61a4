"""Gateway metrics in their own registry, per back end. In-flight and health are read from the router at
scrape time, so a reload that adds or removes back ends shows at once."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from heteroserve.entrypoints.gateway.router import Router

PREFIX = "heteroserve:gateway_"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class _StateCollector:
    def __init__(self, router: Callable[[], Router]) -> None:
        self.router = router

    def collect(self):
        in_flight = GaugeMetricFamily(PREFIX + "in_flight", "Requests outstanding at the back end.", labels=["backend"])
        up = GaugeMetricFamily(PREFIX + "backend_up", "1 if the back end is in rotation.", labels=["backend"])
        for backend in self.router().backends.values():
            in_flight.add_metric([backend.name], backend.outstanding)
            up.add_metric([backend.name], 1.0 if backend.up else 0.0)
        yield in_flight
        yield up


class GatewayMetrics:
    def __init__(self, router: Callable[[], Router]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(router))
        self.requests = Counter(
            PREFIX + "requests",
            "Requests sent to the back end (retries included).",
            ["backend"],
            registry=self.registry,
        )
        self.errors = Counter(
            PREFIX + "errors",
            "Failed attempts: connect (no answer), status (5xx), stream (broke after the first byte).",
            ["backend", "kind"],
            registry=self.registry,
        )
        self.retries = Counter(
            PREFIX + "retries", "Attempts moved away from this back end.", ["backend"], registry=self.registry
        )
        self.latency = Histogram(
            PREFIX + "request_latency_seconds",
            "Time to the back end's answer (its headers), per attempt.",
            ["backend"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
