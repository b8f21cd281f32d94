"""The SRPF plugin passes tokenloom's scheduler conformance suite, and orders as promised."""

from __future__ import annotations

from tokenloom_srpf import SRPFScheduler

from tokenloom.config import EngineConfig
from tokenloom.plugins.kv_cache.paged import PagedKVCache
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.testing import FakeClock, SchedulerConformance


class TestSRPFConformance(SchedulerConformance):
    factory = SRPFScheduler


def _first_started(clock: FakeClock, waited_s: float) -> str:
    config = EngineConfig(max_model_len=256, block_size=4, max_num_seqs=1)
    scheduler = SRPFScheduler(config, PagedKVCache(config, 64, 4), clock=clock)
    params = SamplingParams(max_tokens=1)
    scheduler.add_request(GenerateRequest("long", list(range(1, 201)), params))
    clock.now += waited_s
    scheduler.add_request(GenerateRequest("short", [1, 2, 3], params))
    return scheduler.schedule().chunks[0].request_id


def test_a_short_prompt_overtakes_a_long_one_that_arrived_just_before() -> None:
    assert _first_started(FakeClock(), waited_s=0.1) == "short"


def test_a_long_prompt_that_waited_long_enough_goes_first() -> None:
    assert _first_started(FakeClock(), waited_s=2.0) == "long"  # 200 - 2 * 200 < 3
