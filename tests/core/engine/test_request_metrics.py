"""Per-request metrics through the engine: the injected clock, the first-token and
finished hooks, and ``RequestOutput.metrics`` of the offline ``LLM``."""

from __future__ import annotations

from typing import Any

from tokenloom.config import load_config
from tokenloom.engine.engine_core import Engine
from tokenloom.llm import LLM
from tokenloom.plugin_manager import PluginManager
from tokenloom.protocols.hookspecs import hookimpl
from tokenloom.protocols.outputs import RequestMetrics
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.testing import FakeClock


class Observer:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.first: list[tuple[str, int, float]] = []
        self.finished: dict[str, RequestMetrics | None] = {}

    @hookimpl
    def tokenloom_request_first_token(
        self, request_id: str, num_prompt_tokens: int, num_cached_tokens: int
    ) -> None:
        self.first.append((request_id, num_prompt_tokens, self.clock.now))

    @hookimpl
    def tokenloom_request_finished(self, request_id: str, metrics: Any) -> None:
        self.finished[request_id] = metrics


def test_engine_clock_times_every_request_and_hooks_see_them(tiny_model_factory: Any) -> None:
    clock = FakeClock()
    clock.now = 100.0
    observer = Observer(clock)
    pm = PluginManager.default()
    pm.register(observer, "observer")
    config = load_config(model=str(tiny_model_factory("llama")), max_num_batched_tokens=8)
    engine = Engine.from_config(config, pm, clock=clock)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request(GenerateRequest("short", [5, 6, 7], params))
    engine.add_request(GenerateRequest("long", list(range(3, 15)), params))  # 12 > budget 8
    engine.add_request(GenerateRequest("gone", [9, 9], params))
    engine.abort(["gone"])
    last: dict[str, RequestMetrics] = {}
    while engine.has_unfinished():
        clock.now += 1.0
        for delta in engine.step():
            assert (delta.metrics is not None) == (delta.finish_reason is not None)
            if delta.metrics is not None:
                last[delta.request_id] = delta.metrics
    assert last.keys() == {"short", "long"}
    short, long = last["short"], last["long"]
    # Step 1 (t=101) prefills "short" and 5 tokens of "long": short's first token.
    assert (short.arrival_time, short.first_scheduled_time, short.first_token_time) == (
        100.0, 101.0, 101.0,
    )  # fmt: skip
    # "long" needs a second step for the rest of its prompt (chunked prefill).
    assert (long.first_scheduled_time, long.first_token_time) == (101.0, 102.0)
    assert short.finished_time == 103.0 and long.finished_time == 104.0
    assert (short.queue_time, long.time_to_first_token, long.e2e_time) == (1.0, 2.0, 4.0)
    assert short.num_preemptions == 0 and short.num_cached_tokens == 0
    assert observer.first == [("short", 3, 101.0), ("long", 12, 102.0)]
    assert observer.finished["short"] == short and observer.finished["long"] == long
    gone = observer.finished["gone"]
    assert gone is not None and (gone.first_scheduled_time, gone.first_token_time) == (0.0, 0.0)


def test_offline_generate_returns_metrics_per_request(tiny_model_factory: Any) -> None:
    llm = LLM(str(tiny_model_factory("llama")))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, n=2)
    (output,) = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)
    metrics = output.metrics
    assert metrics is not None
    assert 0 < metrics.arrival_time <= metrics.first_scheduled_time
    assert metrics.first_scheduled_time <= metrics.first_token_time <= metrics.finished_time
    assert [c.metrics is not None for c in output.outputs] == [True, True]
    assert metrics.finished_time == max(
        c.metrics.finished_time for c in output.outputs if c.metrics
    )
