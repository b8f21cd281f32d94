"""Prometheus metrics of the frontends, through ``prometheus_client``.

Latencies, token counts, finished and refused requests are observed by the frontends
as they happen; queue depth, KV usage, prefix-cache and preemption counters come from
the engine's ``EngineStats`` at scrape time (a collector reads the stats that
``render`` is given). Each ``ServingMetrics`` has its own registry, so several servers
in one process (tests) do not collide.

One instance serves every frontend of an engine: ``ServingMetrics.for_engine(engine)``
returns it, and a frontend passes it to its ``LiveGenerations`` (which observes TTFT,
inter-token and end-to-end latency and finished requests) and calls ``record_refused``
for what it turns away. The HTTP frontend exposes it at ``/metrics``, so ZeroMQ jobs
count there too.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenloom.protocols.outputs import EngineStats, RequestMetrics

disable_created_metrics()  # no ``*_created`` series (process-wide in prometheus_client)
PREFIX = "tokenloom_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class _EngineCollector(Collector):
    """The engine's gauges and counters, from the stats of the current scrape."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None
        self.engine_alive = False

    def collect(self) -> Iterator[Metric]:
        yield _gauge("engine_alive", "1 while the engine-core process serves.", self.engine_alive)
        stats = self.stats
        if stats is None:
            return
        yield _gauge("num_requests_waiting", "Requests waiting.", stats.num_waiting)
        yield _gauge("num_requests_running", "Requests running.", stats.num_running)
        yield _gauge("kv_blocks_total", "KV cache blocks.", stats.num_blocks_total)
        yield _gauge("kv_blocks_free", "Free KV cache blocks.", stats.num_blocks_free)
        yield _gauge("kv_cache_usage_ratio", "Used fraction of KV blocks.", stats.kv_usage)
        hit_rate = stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1)
        yield _gauge("prefix_cache_hit_rate", "Prefix-cache token hit rate.", hit_rate)
        yield _counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
        )  # fmt: skip
        yield _counter("prefix_cache_hits", "Of which cached.", stats.prefix_cache_hits)
        yield _counter("num_preemptions", "Preemptions.", stats.num_preemptions)
        yield _counter(
            "spec_decode_num_draft_tokens", "Speculative draft tokens verified.",
            stats.spec_draft_tokens_total,
        )  # fmt: skip
        yield _counter(
            "spec_decode_num_accepted_tokens", "Of which accepted.",
            stats.spec_accepted_tokens_total,
        )  # fmt: skip
        yield _counter(
            "spec_decode_num_verify_steps", "Request-steps that verified drafts.",
            stats.spec_verify_steps_total,
        )  # fmt: skip
        yield _gauge(
            "spec_decode_acceptance_rate", "Accepted drafts per verified draft.",
            stats.spec_acceptance_rate,
        )  # fmt: skip
        yield _gauge(
            "spec_decode_mean_accepted_length", "Tokens per verify step (accepted + 1).",
            stats.spec_mean_accepted_length,
        )  # fmt: skip
        yield _counter(
            "engine_prompt_tokens", "Prompt tokens computed by the engine.",
            stats.prompt_tokens_total,
        )  # fmt: skip


class ServingMetrics:
    """What the frontends measure per request; ``render`` adds the engine's gauges."""

    _shared: weakref.WeakKeyDictionary[Any, ServingMetrics] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self._engine = _EngineCollector()
        registry.register(self._engine)

        def histogram(name: str, help_text: str) -> Histogram:
            return Histogram(PREFIX + name, help_text, buckets=LATENCY_BUCKETS, registry=registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to finish.")
        self.queue_time = histogram(
            "request_queue_time_seconds", "Engine requests' wait, arrival to first scheduled."
        )
        self._request_preemptions = Counter(
            PREFIX + "request_preemptions", "Preemptions of finished engine requests.",
            registry=registry,
        )  # fmt: skip
        self._finished = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.",
            ["finished_reason"], registry=registry,
        )  # fmt: skip
        self._refused = Counter(
            PREFIX + "request_refused", "Requests refused before they ran, by HTTP-like status.",
            ["status"], registry=registry,
        )  # fmt: skip
        self._prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of requests.", registry=registry
        )
        self._generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens.", registry=registry
        )
        self.requests_total: dict[str, int] = {}  # finish reason -> count

    @classmethod
    def for_engine(cls, engine: Any) -> ServingMetrics:
        """The metrics every frontend of ``engine`` shares (created on first use)."""
        metrics = cls._shared.get(engine)
        if metrics is None:
            metrics = cls._shared[engine] = cls()
        return metrics

    def record_finished(self, finish_reason: str, prompt_tokens: int, generated: int) -> None:
        self.requests_total[finish_reason] = self.requests_total.get(finish_reason, 0) + 1
        self._finished.labels(finish_reason).inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(generated)

    def observe_engine_metrics(self, metrics: RequestMetrics) -> None:
        """An engine request finished with these timings (one per choice)."""
        if metrics.first_scheduled_time:
            self.queue_time.observe(metrics.queue_time)
        self._request_preemptions.inc(metrics.num_preemptions)

    def record_refused(self, status: int) -> None:
        """A request turned away before it ran (400, 413, 429, 503, ...)."""
        self._refused.labels(str(status)).inc()

    def render(self, stats: EngineStats | None, engine_alive: bool) -> bytes:
        """The exposition text (``CONTENT_TYPE``), with ``stats`` as the engine's part."""
        self._engine.stats = stats
        self._engine.engine_alive = engine_alive
        try:
            return generate_latest(self.registry)
        finally:
            self._engine.stats = None


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, help_text, value=float(value))


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, help_text, value=float(value))
