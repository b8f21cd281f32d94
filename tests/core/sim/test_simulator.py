"""The simulation loop: the real scheduler and KV plugins, a simulated clock that
advances by the cost model, and timings that follow from it exactly."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from tokenloom.config import EngineConfig
from tokenloom.sim.cost_model import CostModel, ModelShape, StepFeatures
from tokenloom.sim.metrics import summarize
from tokenloom.sim.simulator import simulate
from tokenloom.sim.workload import TraceRequest, synthetic

EXAMPLE = Path(__file__).parents[3] / "examples" / "schedulers" / "spf_aging.py"


@pytest.fixture(scope="module")
def plugins():
    from tokenloom.sim.cli import load_plugins

    return load_plugins([str(EXAMPLE)])


@pytest.fixture(scope="module")
def cost():
    return CostModel.shipped("llama-3-8b")


def _config(**changes) -> EngineConfig:
    base = {"model": "x", "max_model_len": 4096, "num_blocks": 4096, "max_num_seqs": 64}
    return EngineConfig(**(base | changes))


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_lone_request_takes_one_prefill_then_one_decode_step_per_token(plugins, cost, pipelined):
    trace = [TraceRequest(0.5, 300, 5)]
    result = simulate(trace, _config(), cost, plugins, pipelined=pipelined)
    rec = result.requests[0]
    prefill = cost.step_time(StepFeatures(1, 300, 0, 300, 300 * 301 // 2, 1, 0))
    decodes = [cost.step_time(StepFeatures(1, 1, 1, p + 1, p + 1, 1, 1)) for p in range(300, 304)]
    assert rec.finish_reason == "length" and rec.num_output == 5
    assert rec.started == pytest.approx(0.5)
    assert rec.first_token - rec.arrival == pytest.approx(prefill)
    assert rec.finished - rec.arrival == pytest.approx(prefill + sum(decodes))


def test_every_request_completes_with_its_output_length_under_kv_pressure(plugins, cost):
    trace = synthetic(60, 200.0, prompt_len=200, output_len=150, length_dist="uniform", seed=3)
    # 60 blocks of 16 tokens: a handful of requests at a time, so some are preempted.
    result = simulate(trace, _config(num_blocks=60), cost, plugins)
    for want, rec in zip(trace, result.requests, strict=True):
        assert rec.num_output == want.output_len and rec.finish_reason == "length"
        assert rec.arrival <= rec.started <= rec.first_token <= rec.finished
    assert result.num_preemptions > 0 and result.recomputed_tokens > 0
    assert summarize(result.requests)["preemptions"] == result.num_preemptions


def test_continuous_beats_static_on_staggered_arrivals(plugins, cost):
    trace = synthetic(200, 40.0, prompt_len=400, output_len=200, length_dist="lognormal", seed=1)
    ttft = {}
    for name in ("continuous", "static"):
        result = simulate(trace, _config(scheduler=name, max_num_seqs=32), cost, plugins)
        ttft[name] = summarize(result.requests)["ttft_ms"]["mean"]
    assert ttft["continuous"] < 0.5 * ttft["static"]


def test_example_spf_aging_serves_short_prompts_first_in_a_burst(plugins, cost):
    # Long prompts arrive a moment before short ones, in one burst.
    trace = [TraceRequest(0.0, 6000, 10) for _ in range(20)]
    trace += [TraceRequest(0.001, 50, 10) for _ in range(20)]
    short_ttft = {}
    for name in ("continuous", "spf-aging"):
        result = simulate(
            trace, _config(scheduler=name, max_model_len=8192, num_blocks=20000), cost, plugins
        )
        shorts = [r.first_token - r.arrival for r in result.requests[20:]]
        short_ttft[name] = sorted(shorts)[10]
        assert all(r.num_output == 10 for r in result.requests)
    assert short_ttft["spf-aging"] < 0.2 * short_ttft["continuous"]


def test_deadlines_expire_on_the_simulated_clock(plugins):
    slow = CostModel(ModelShape.named("llama-3-8b"), {"const": 0.1})  # 100 ms per step
    trace = [TraceRequest(0.0, 100, 50, deadline_s=1.0)]
    result = simulate(trace, _config(), slow, plugins, pipelined=False)
    rec = result.requests[0]
    assert rec.finish_reason == "timeout"
    assert 8 <= rec.num_output <= 11  # ~10 steps of 100 ms fit in the 1 s deadline
    assert rec.finished == pytest.approx(1.0, abs=0.11)


def test_refused_requests_are_reported_not_lost(plugins, cost):
    trace = [TraceRequest(0.0, 5000, 4), TraceRequest(0.0, 100, 4)]
    result = simulate(trace, _config(max_model_len=4096), cost, plugins)
    assert result.requests[0].finish_reason == "rejected"
    assert result.requests[1].num_output == 4
    summary = summarize(result.requests)
    assert summary["rejected"] == 1 and summary["completed"] == 1
    assert math.isnan(result.requests[0].first_token)


@pytest.mark.slow
def test_ten_thousand_requests_simulate_in_under_a_minute(plugins, cost):
    trace = synthetic(10_000, 20.0, prompt_len=1024, output_len=128, length_dist="lognormal")
    started = time.perf_counter()
    result = simulate(
        trace, _config(max_num_seqs=256, max_model_len=65536, num_blocks=50_000), cost, plugins
    )
    elapsed = time.perf_counter() - started
    assert sum(r.num_output for r in result.requests) == sum(r.output_len for r in trace)
    assert elapsed < 60, f"{elapsed:.1f}s"
