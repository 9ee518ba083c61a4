"""Server metrics. Engine-wide figures are read from the scheduler at scrape time; per-request ones are
observed when a request finishes, is aborted, or starts (its sampling parameters). Every metric is registered once,
named `heteroserve:<what>` after vLLM's `vllm:<what>`, and exported under the prefixes --metrics-prefix chooses,
so vLLM's dashboards, routers and autoscalers read the same series as ours."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from heteroserve.engine.llm_engine import LLMEngine
from heteroserve.metrics import METRICS_PREFIXES, PREFIX, VLLM_PREFIX
from heteroserve.outputs import RequestMetrics
from heteroserve.platforms.operators import OPERATORS

# vLLM's older names for series we export, still read by its dashboards and routers: also exported under vllm:.
VLLM_OLD_NAMES = {
    "kv_cache_usage_perc": "gpu_cache_usage_perc",
    "prefix_cache_queries": "gpu_prefix_cache_queries",
    "prefix_cache_hits": "gpu_prefix_cache_hits",
}
ABORT_REASONS = ("client_disconnect", "timeout", "engine_error", "grammar_error")

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's
_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: vLLM's buckets for token counts per request."""
    found, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(found)
            found.append(mantissa * scale)
        scale *= 10


class BucketCounts:
    """A histogram kept as plain counts, for counts binned at scrape time (steps by token count), which
    prometheus_client's Histogram cannot take."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound
        self.sum = 0.0

    def observe(self, value: float, times: int) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def family(self, name: str, doc: str, labels: Mapping[str, str]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=list(labels))
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, map(float, self.bounds)), "+Inf"), self.counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        family.add_metric(list(labels.values()), buckets, self.sum)
        return family


class _EngineCollector:
    """The scheduler's figures, read when Prometheus scrapes."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.labels = {"model_name": model_name}

    def collect(self) -> Iterator[Metric]:
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
            ("spec_decode_num_drafts", "Steps of a request that checked speculative drafts.", stats.spec_num_drafts),
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
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative draft tokens the model confirmed, by their place among a step's drafts (0: the first).",
            labels=[*names, "position"],
        )
        for position, count in enumerate(stats.spec_accepted_per_position):
            per_position.add_metric([*values, str(position)], count)
        yield per_position
        if self.engine.config.lora is not None:  # vLLM's: the value is the time of the scrape
            info = GaugeMetricFamily(
                PREFIX + "lora_requests_info",
                "LoRA adapters in use: running_lora_adapters and waiting_lora_adapters (comma-separated names).",
                labels=[*names, "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            )
            lora_labels = [
                str(self.engine.config.lora.max_loras),
                ",".join(stats.running_lora_adapters),
                ",".join(stats.waiting_lora_adapters),
            ]
            info.add_metric([*values, *lora_labels], time.time())
            yield info
        steps = BucketCounts(_ITERATION_TOKEN_BUCKETS)
        for tokens, count in stats.step_token_counts.items():
            steps.observe(tokens, count)
        yield steps.family(PREFIX + "iteration_tokens_total", "Tokens per engine step.", self.labels)
        fallbacks = CounterMetricFamily(
            PREFIX + "operator_fallbacks",
            "Operator calls the device could not run, run on the CPU instead.",
            labels=[*names, "operator"],
        )
        counts = self.engine.platform.operator_fallbacks
        for operator in OPERATORS:
            fallbacks.add_metric([*values, operator], counts[operator])
        yield fallbacks
        references = CounterMetricFamily(
            PREFIX + "linear_reference_calls",
            "Products by weights the platform has no kernel for, dequantised on every call, by weight format.",
            labels=[*names, "format"],
        )
        formats = {"int4": 0, "int8": 0}
        formats.update({key.removeprefix("linear "): n for key, n in counts.items() if key.startswith("linear ")})
        for name, count in formats.items():
            references.add_metric([*values, name], count)
        yield references


class _Prefixed:
    """Exports the families of `source` (all named heteroserve:*) under each of `prefixes`; under vllm: also by
    vLLM's older names (VLLM_OLD_NAMES). Metrics without our prefix (process_*) pass through unchanged."""

    def __init__(self, source: CollectorRegistry, prefixes: tuple[str, ...]) -> None:
        self.source = source
        self.prefixes = prefixes

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            if not family.name.startswith(PREFIX):
                yield family
                continue
            what = family.name[len(PREFIX) :]
            for prefix in self.prefixes:
                yield _renamed(family, prefix + what)
                if prefix == VLLM_PREFIX and what in VLLM_OLD_NAMES:
                    yield _renamed(family, prefix + VLLM_OLD_NAMES[what])


def _renamed(family: Metric, name: str) -> Metric:
    if name == family.name:
        return family
    copy = Metric(name, family.documentation, family.type, family.unit)
    copy.samples = [sample._replace(name=name + sample.name[len(family.name) :]) for sample in family.samples]
    return copy


class ServerMetrics:
    """The server's metrics; `registry` is what /metrics exports (with the process's RSS, CPU time and open fds)."""

    def __init__(self, engine: LLMEngine, model_name: str, prefix: str = "both") -> None:
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {', '.join(METRICS_PREFIXES)}, got {prefix!r}")
        own = CollectorRegistry()
        own.register(_EngineCollector(engine, model_name))
        self.registry = CollectorRegistry()
        self.registry.register(_Prefixed(own, METRICS_PREFIXES[prefix]))
        ProcessCollector(registry=self.registry)
        labels = ["model_name"]
        self.model_name = model_name

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=own)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=own)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter("request_success", "Finished requests by finish reason.", ("finished_reason",))
        self.request_aborted = counter(
            "request_aborted",
            "API requests that ended before their answer, by reason (client_disconnect, timeout, engine_error).",
            ("reason",),
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.tpot = histogram(
            "time_per_output_token_seconds", "Mean time per output token after the first.", _TOKEN_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between engine steps that gave a request new tokens.", _TOKEN_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", _LATENCY_BUCKETS
        )
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token.", _LATENCY_BUCKETS)
        self.inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to last token (prefill + decode).", _LATENCY_BUCKETS
        )
        per_request = buckets_1_2_5(engine.model.max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", per_request)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", per_request
        )
        self.max_tokens_param = histogram(
            "request_params_max_tokens", "The max_tokens each request asked for.", per_request
        )
        self.n_param = histogram("request_params_n", "The n each request asked for.", _N_BUCKETS)
        cache = engine.config.cache
        info = {
            "block_size": cache.block_size,
            "cache_dtype": cache.kv_cache_dtype,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "gpu_memory_utilization": cache.gpu_memory_utilization,
            "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
            "num_gpu_blocks": engine.scheduler.kv_cache.num_blocks,
        }
        Gauge(
            PREFIX + "cache_config_info",
            "The KV cache's configuration (labels); always 1.",
            [*labels, *info],
            registry=own,
        ).labels(model_name, *map(str, info.values())).set(1)

        self.pooling_requests = counter(
            "pooling_requests",
            "Finished pooling requests (one per text embedded or pair a cross-encoder scored) by task.",
            ("task",),
        )
        self.pooling_prompt_tokens = counter(
            "pooling_prompt_tokens",
            "Prompt tokens of finished pooling requests by task (also counted in prompt_tokens).",
            ("task",),
        )

        # Export every series from the start, so dashboards and alerts see zeros rather than nothing.
        for metric in (
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.tpot,
            self.e2e,
            self.queue_time,
            self.prefill_time,
            self.decode_time,
            self.inference_time,
            self.request_prompt_tokens,
            self.request_generation_tokens,
            self.max_tokens_param,
            self.n_param,
        ):
            metric.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        for reason in ABORT_REASONS:
            self.request_aborted.labels(model_name, reason)
        if engine.model.task != "generate":
            self.pooling_requests.labels(model_name, engine.model.task)
            self.pooling_prompt_tokens.labels(model_name, engine.model.task)

    def observe_params(self, n: int, max_tokens: int | None) -> None:
        """A generation request's sampling parameters, when it starts."""
        self.n_param.labels(self.model_name).observe(n)
        if max_tokens is not None:
            self.max_tokens_param.labels(self.model_name).observe(max_tokens)

    def observe_aborted(self, reason: str) -> None:
        """An API request that ends without its answer (`reason`: one of ABORT_REASONS); also a finish by abort."""
        self.request_aborted.labels(self.model_name, reason).inc()
        self.request_success.labels(self.model_name, "abort").inc()

    def observe_finished(
        self, metrics: RequestMetrics | None, prompt_tokens: int, output_tokens: int, finish_reason: str | None
    ) -> None:
        label = self.model_name
        self.prompt_tokens.labels(label).inc(prompt_tokens)
        self.generation_tokens.labels(label).inc(output_tokens)
        self.request_success.labels(label, finish_reason or "abort").inc()
        self.request_prompt_tokens.labels(label).observe(prompt_tokens)
        self.request_generation_tokens.labels(label).observe(output_tokens)
        if metrics is None:
            return
        scheduled, first, finished = metrics.first_scheduled_time, metrics.first_token_time, metrics.finished_time
        if first is not None:
            self.ttft.labels(label).observe(first - metrics.arrival_time)
            if finished is not None and output_tokens > 1:
                self.tpot.labels(label).observe((finished - first) / (output_tokens - 1))
        for gap in metrics.inter_token_gaps:
            self.inter_token_latency.labels(label).observe(gap)
        if finished is not None:
            self.e2e.labels(label).observe(finished - metrics.arrival_time)
        if scheduled is not None:
            self.queue_time.labels(label).observe(scheduled - metrics.arrival_time)
            if first is not None:
                self.prefill_time.labels(label).observe(first - scheduled)
            if finished is not None:
                self.inference_time.labels(label).observe(finished - scheduled)
        if first is not None and finished is not None:
            self.decode_time.labels(label).observe(finished - first)

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
