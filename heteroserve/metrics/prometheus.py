"""Server metrics. Engine-wide figures are read from the scheduler at scrape time; per-request ones are
observed when a request finishes. Names follow vLLM's, so dashboards port by changing the prefix."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from heteroserve.engine.llm_engine import LLMEngine
from heteroserve.outputs import RequestMetrics
from heteroserve.platforms.operators import OPERATORS

PREFIX = "heteroserve:"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class _EngineCollector:
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.labels = {"model_name": model_name}

    def collect(self):
        stats = self.engine.stats()
        names = list(self.labels)
        values = list(self.labels.values())
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", stats.kv_usage),
        ):
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            gauge.add_metric(values, value)
            yield gauge
        for name, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_hits),
            ("num_preemptions", "Requests preempted for lack of KV blocks.", stats.num_preemptions),
            ("spec_decode_num_draft_tokens", "Speculative draft tokens checked.", stats.spec_draft_tokens),
            (
                "spec_decode_num_accepted_tokens",
                "Speculative draft tokens the model confirmed.",
                stats.spec_accepted_tokens,
            ),
        ):
            counter = CounterMetricFamily(PREFIX + name, doc, labels=names)
            counter.add_metric(values, value)
            yield counter
        fallbacks = CounterMetricFamily(
            PREFIX + "operator_fallbacks",
            "Operator calls the device could not run, run on the CPU instead.",
            labels=[*names, "operator"],
        )
        counts = self.engine.platform.operator_fallbacks
        for operator in OPERATORS:
            fallbacks.add_metric([*values, operator], counts[operator])
        yield fallbacks


class ServerMetrics:
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        labels = ["model_name"]
        self.model_name = model_name
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens processed.", labels, registry=self.registry
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated.", labels, registry=self.registry
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time per output token after the first.",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to finish.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Arrival to first scheduled.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

        self.pooling_requests = Counter(
            PREFIX + "pooling_requests",
            "Finished pooling requests (one per text embedded or pair a cross-encoder scored) by task.",
            [*labels, "task"],
            registry=self.registry,
        )
        self.pooling_prompt_tokens = Counter(
            PREFIX + "pooling_prompt_tokens",
            "Prompt tokens of finished pooling requests by task (also counted in prompt_tokens).",
            [*labels, "task"],
            registry=self.registry,
        )

        # Export every series from the start, so dashboards and alerts see zeros rather than nothing.
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.e2e, self.queue_time):
            metric.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        if engine.task != "generate":
            self.pooling_requests.labels(model_name, engine.task)
            self.pooling_prompt_tokens.labels(model_name, engine.task)

    def observe_finished(
        self, metrics: RequestMetrics | None, prompt_tokens: int, output_tokens: int, finish_reason: str | None
    ) -> None:
        label = self.model_name
        self.prompt_tokens.labels(label).inc(prompt_tokens)
        self.generation_tokens.labels(label).inc(output_tokens)
        self.request_success.labels(label, finish_reason or "abort").inc()
        if metrics is None:
            return
        if metrics.first_token_time is not None:
            self.ttft.labels(label).observe(metrics.first_token_time - metrics.arrival_time)
            if metrics.finished_time is not None and output_tokens > 1:
                self.tpot.labels(label).observe(
                    (metrics.finished_time - metrics.first_token_time) / (output_tokens - 1)
                )
        if metrics.finished_time is not None:
            self.e2e.labels(label).observe(metrics.finished_time - metrics.arrival_time)
        if metrics.first_scheduled_time is not None:
            self.queue_time.labels(label).observe(metrics.first_scheduled_time - metrics.arrival_time)

    def observe_pooling(self, task: str, metrics: RequestMetrics | None, prompt_tokens: int) -> None:
        """A finished pooling request (`task`: embed or score): counted, its prompt tokens added to the pooling and
        the overall counts, its end-to-end and queue times observed."""
        label = self.model_name
        self.pooling_requests.labels(label, task).inc()
        self.pooling_prompt_tokens.labels(label, task).inc(prompt_tokens)
        self.prompt_tokens.labels(label).inc(prompt_tokens)
        if metrics is None:
            return
        if metrics.finished_time is not None:
            self.e2e.labels(label).observe(metrics.finished_time - metrics.arrival_time)
        if metrics.first_scheduled_time is not None:
            self.queue_time.labels(label).observe(metrics.first_scheduled_time - metrics.arrival_time)
