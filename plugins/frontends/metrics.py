"""Prometheus metrics of the frontends, rendered in the text exposition format.

Latencies and token counts observed by the frontend are kept here; queue depth, KV
usage, prefix-cache and preemption counters come from the engine's ``EngineStats``
at scrape time. No dependency on a Prometheus client library.
"""

from __future__ import annotations

import bisect

from tokenloom.protocols.outputs import EngineStats

PREFIX = "tokenloom_"
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class Histogram:
    """Cumulative-bucket histogram (seconds)."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name = PREFIX + name
        self.help_text = help_text
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last slot: +Inf only
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, lines: list[str]) -> None:
        lines.append(f"# HELP {self.name} {self.help_text}")
        lines.append(f"# TYPE {self.name} histogram")
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts, strict=False):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {self.total}")
        lines.append(f"{self.name}_count {self.count}")


class ServingMetrics:
    """What the frontend measures per request; ``render`` adds the engine's gauges."""

    def __init__(self) -> None:
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = Histogram("inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = Histogram("e2e_request_latency_seconds", "Request latency, arrival to finish.")
        self.requests_total: dict[str, int] = {}  # finish reason -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def record_finished(self, finish_reason: str, prompt_tokens: int, generated: int) -> None:
        self.requests_total[finish_reason] = self.requests_total.get(finish_reason, 0) + 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generated

    def render(self, stats: EngineStats | None, engine_alive: bool) -> str:
        lines: list[str] = []
        _gauge(lines, "engine_alive", "1 while the engine-core process serves.", engine_alive)
        if stats is not None:
            _gauge(lines, "num_requests_waiting", "Requests waiting.", stats.num_waiting)
            _gauge(lines, "num_requests_running", "Requests running.", stats.num_running)
            _gauge(lines, "kv_blocks_total", "KV cache blocks.", stats.num_blocks_total)
            _gauge(lines, "kv_blocks_free", "Free KV cache blocks.", stats.num_blocks_free)
            _gauge(lines, "kv_cache_usage_ratio", "Used fraction of KV blocks.", stats.kv_usage)
            hit_rate = stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1)
            _gauge(lines, "prefix_cache_hit_rate", "Prefix-cache token hit rate.", hit_rate)
            _counter(
                lines, "prefix_cache_queries_total", "Prompt tokens looked up in the prefix "
                "cache.", stats.prefix_cache_queries,
            )  # fmt: skip
            _counter(lines, "prefix_cache_hits_total", "Of which cached.", stats.prefix_cache_hits)
            _counter(lines, "num_preemptions_total", "Preemptions.", stats.num_preemptions)
            _counter(
                lines, "engine_prompt_tokens_total", "Prompt tokens computed by the engine.",
                stats.prompt_tokens_total,
            )  # fmt: skip
        _counter(lines, "prompt_tokens_total", "Prompt tokens of requests.", self.prompt_tokens)
        _counter(lines, "generation_tokens_total", "Generated tokens.", self.generation_tokens)
        name = PREFIX + "request_success_total"
        lines.append(f"# HELP {name} Finished requests by finish reason.")
        lines.append(f"# TYPE {name} counter")
        for reason, count in sorted(self.requests_total.items()):
            lines.append(f'{name}{{finished_reason="{reason}"}} {count}')
        for histogram in (self.ttft, self.itl, self.e2e):
            histogram.render(lines)
        return "\n".join(lines) + "\n"


def _gauge(lines: list[str], name: str, help_text: str, value: float) -> None:
    _sample(lines, "gauge", name, help_text, value)


def _counter(lines: list[str], name: str, help_text: str, value: float) -> None:
    _sample(lines, "counter", name, help_text, value)


def _sample(lines: list[str], kind: str, name: str, help_text: str, value: float) -> None:
    name = PREFIX + name
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    lines.append(f"{name} {float(value)}")
