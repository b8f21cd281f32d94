"""The continuous scheduler, step by step, against the checking fake executor."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tokenloom.config import EngineConfig
from tokenloom.plugins.kv_cache.paged import PagedKVCache
from tokenloom.plugins.scheduler.continuous import (
    ContinuousScheduler,
    tokenloom_register_components,
)
from tokenloom.plugins.scheduler.fake_executor import (
    FakeExecutor,
    Generation,
    collect,
    next_token,
    run_until_idle,
)
from tokenloom.protocols.components.errors import QueueFullError
from tokenloom.protocols.outputs import FinishReason, TopLogprobs
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.protocols.step import PLACEHOLDER_TOKEN, StepOutput

BS = 4
VOCAB = 64
EOS = 0


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(
    num_blocks: int = 64, clock: FakeClock | None = None, **options: Any
) -> tuple[ContinuousScheduler, PagedKVCache, FakeExecutor]:
    options.setdefault("max_model_len", 512)
    config = EngineConfig(block_size=BS, **options)
    kv = PagedKVCache(config, num_blocks, BS)
    scheduler = ContinuousScheduler(config, kv, clock or FakeClock())
    return scheduler, kv, FakeExecutor(num_blocks, BS, VOCAB)


def request(
    request_id: str, prompt: list[int], max_tokens: int | None = 8, **fields: Any
) -> GenerateRequest:
    params = fields.pop("params", None) or SamplingParams(max_tokens=max_tokens)
    return GenerateRequest(request_id, prompt, params, eos_token_ids=[EOS], **fields)


def expected_tokens(prompt: list[int], generation: Generation) -> list[int]:
    """What the fake model generates for ``prompt``, as long as ``generation``."""
    history = list(prompt)
    for _ in generation.token_ids:
        history.append(next_token(history, VOCAB))
    return history[len(prompt) :]


def random_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 30))] for _ in range(count)]


def test_registers_as_scheduler_continuous() -> None:
    (spec,) = tokenloom_register_components()
    assert (spec.kind, spec.name, spec.factory) == ("scheduler", "continuous", ContinuousScheduler)


@pytest.mark.parametrize("pipelined", [False, True])
def test_preempted_request_resumes_with_identical_tokens(pipelined: bool) -> None:
    prompts = random_prompts(12)
    results = []
    for num_blocks in (512, 24):
        scheduler, _, executor = make(num_blocks, max_num_seqs=8, max_num_batched_tokens=32)
        for i, prompt in enumerate(prompts):
            scheduler.add_request(request(f"r{i}", prompt, max_tokens=40))
        results.append(run_until_idle(scheduler, executor, pipelined=pipelined))
        if num_blocks == 24:
            assert scheduler.stats().num_preemptions > 0
    unconstrained, constrained = results
    assert constrained == unconstrained
    for i, prompt in enumerate(prompts):
        assert constrained[f"r{i}"].token_ids == expected_tokens(prompt, constrained[f"r{i}"])


def test_pipelined_scheduling_keeps_one_step_in_flight_and_the_same_tokens() -> None:
    prompts = random_prompts(10, seed=5)
    runs = []
    for pipelined in (False, True):
        scheduler, _, executor = make(48, max_num_seqs=6, max_num_batched_tokens=24)
        for i, prompt in enumerate(prompts):
            scheduler.add_request(request(f"r{i}", prompt, max_tokens=20))
        runs.append(run_until_idle(scheduler, executor, pipelined=pipelined))
        assert scheduler.generation_tokens_total == sum(len(g.token_ids) for g in runs[-1].values())
    assert runs[0] == runs[1]
    # Built before the previous step's output is in: decodes carry a placeholder, and
    # a request whose pending token reaches max_tokens is not scheduled again.
    scheduler, _, executor = make()
    scheduler.add_request(request("a", [5, 6, 7], max_tokens=3))
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert [c.token_ids for c in second.chunks] == [[PLACEHOLDER_TOKEN]]
    assert second.chunks[0].start_pos == 3 and second.chunks[0].sample
    third = scheduler.schedule()
    assert third.chunks[0].start_pos == 4
    assert not scheduler.schedule().chunks  # 3 pending tokens = max_tokens
    deltas = [scheduler.update(s, executor.execute(s)) for s in (first, second, third)]
    assert [d[0].finish_reason for d in deltas] == [None, None, FinishReason.LENGTH]


def test_a_reused_request_id_is_not_confused_with_its_old_step_in_flight() -> None:
    # Pipelined: the old R's second step is still in flight when R is aborted and a
    # new R arrives; that step's token must not land in the new R.
    scheduler, _, _ = make()
    scheduler.add_request(request("R", [7, 7, 7], max_tokens=10))
    first = scheduler.schedule()
    second = scheduler.schedule()
    scheduler.update(first, StepOutput(first.step_id, ["R"], [[98]]))
    scheduler.abort_requests(["R"])
    scheduler.add_request(request("R", [5, 5], max_tokens=4))
    third = scheduler.schedule()
    assert [c.token_ids for c in third.chunks] == [[5, 5]]
    assert scheduler.update(second, StepOutput(second.step_id, ["R"], [[99]])) == []
    deltas = scheduler.update(third, StepOutput(third.step_id, ["R"], [[11]]))
    assert [d.new_token_ids for d in deltas] == [[11]]
    fourth = scheduler.schedule()
    assert [(c.start_pos, c.token_ids) for c in fourth.chunks] == [(2, [11])]


def test_new_request_data_is_sent_once_even_across_preemption() -> None:
    scheduler, _, executor = make(12, max_num_seqs=4)
    for i, prompt in enumerate(random_prompts(6, seed=3)):
        scheduler.add_request(request(f"r{i}", prompt, max_tokens=30))
    sent: list[str] = []
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        sent.extend(new.request_id for new in step.new_requests)
        scheduler.update(step, executor.execute(step))
    assert scheduler.stats().num_preemptions > 0
    assert sorted(sent) == sorted(f"r{i}" for i in range(6))


def test_prefix_sharing_hits_the_cache_and_computes_fewer_tokens() -> None:
    prompt = list(range(1, 23))  # 22 tokens: 5 full blocks usable
    computed = {}
    for caching in (True, False):
        scheduler, _, executor = make(enable_prefix_caching=caching)
        scheduler.add_request(request("a", prompt))
        first = run_until_idle(scheduler, executor)
        scheduler.add_request(request("b", prompt))
        second = run_until_idle(scheduler, executor)
        assert second["b"].token_ids == first["a"].token_ids
        computed[caching] = executor.num_computed_tokens
        if caching:
            assert second["b"].num_cached_tokens == 20
            assert second["b"].num_prompt_tokens == 22
            stats = scheduler.stats()
            assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (44, 20)
    assert computed[False] - computed[True] == 20


def test_n_siblings_in_one_batch_share_the_prompt_blocks() -> None:
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks
    scheduler, kv, executor = make()
    for i in range(3):
        scheduler.add_request(request(f"s{i}", prompt))
    first = scheduler.schedule()
    assert [chunk.request_id for chunk in first.chunks] == ["s0"]  # siblings wait one step
    results: dict[str, Generation] = {}
    collect(scheduler.update(first, executor.execute(first)), results)
    second = scheduler.schedule()
    tables = {chunk.request_id: chunk.block_ids for chunk in second.chunks}
    assert tables["s1"][:4] == tables["s0"][:4] == tables["s2"][:4]
    assert kv.ref_count(tables["s0"][0]) == 3
    collect(scheduler.update(second, executor.execute(second)), results)
    run_until_idle(scheduler, executor, results=results)
    assert results["s1"].num_cached_tokens == results["s2"].num_cached_tokens == 16
    assert results["s0"].token_ids == results["s1"].token_ids == results["s2"].token_ids


def test_waiting_requests_start_by_priority_then_arrival() -> None:
    scheduler, _, executor = make(max_num_seqs=1)
    scheduler.add_request(request("late-low", [1, 2], priority=5))
    scheduler.add_request(request("high-1", [1, 2], priority=0))
    scheduler.add_request(request("high-2", [1, 2], priority=0))
    order = []
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        order.extend(new.request_id for new in step.new_requests)
        scheduler.update(step, executor.execute(step))
    assert order == ["high-1", "high-2", "late-low"]


def test_chunked_prefill_continues_next_step_alongside_decodes() -> None:
    scheduler, _, executor = make(max_num_batched_tokens=8)
    scheduler.add_request(request("short", [1, 2, 3], max_tokens=10))
    step = scheduler.schedule()
    scheduler.update(step, executor.execute(step))
    scheduler.add_request(request("long", list(range(1, 21))))
    step = scheduler.schedule()
    decode, chunk = step.chunks
    assert (decode.request_id, len(decode.token_ids), decode.sample) == ("short", 1, True)
    assert (chunk.request_id, chunk.start_pos, len(chunk.token_ids), chunk.sample) == (
        "long",
        0,
        7,
        False,
    )
    output = executor.execute(step)
    assert output.request_ids == ["short"]
    scheduler.update(step, output)
    step = scheduler.schedule()
    assert [(c.request_id, c.start_pos, len(c.token_ids)) for c in step.chunks] == [
        ("short", 4, 1),
        ("long", 7, 7),
    ]
    assert step.num_tokens == 8


def test_max_num_seqs_and_token_budget_bound_every_step() -> None:
    scheduler, _, executor = make(256, max_num_seqs=3, max_num_batched_tokens=10)
    for i, prompt in enumerate(random_prompts(10, seed=7)):
        scheduler.add_request(request(f"r{i}", prompt))
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        assert len(step.chunks) <= 3
        assert step.num_tokens <= 10
        scheduler.update(step, executor.execute(step))


def test_deadline_times_out_running_and_waiting_requests() -> None:
    clock = FakeClock()
    scheduler, kv, executor = make(clock=clock, max_num_seqs=1)
    scheduler.add_request(request("running", [1, 2, 3], max_tokens=50, deadline=1.0))
    scheduler.add_request(request("waiting", [4, 5, 6], max_tokens=50, deadline=2.0))
    scheduler.add_request(request("patient", [7, 8, 9], max_tokens=2))
    step = scheduler.schedule()
    scheduler.update(step, executor.execute(step))
    clock.now += 3.0
    step = scheduler.schedule()
    assert set(step.finished_request_ids) == {"running", "waiting"}
    assert [chunk.request_id for chunk in step.chunks] == ["patient"]
    deltas = scheduler.update(step, executor.execute(step))
    reasons = {d.request_id: d.finish_reason for d in deltas}
    assert reasons["running"] == reasons["waiting"] == FinishReason.TIMEOUT
    assert kv.request_ids() == ["patient"]


def test_timeout_while_only_waiting_still_yields_a_step_that_emits_it() -> None:
    clock = FakeClock()
    scheduler, kv, executor = make(4, clock=clock)
    scheduler.add_request(request("hog", [1] * 12, max_tokens=1))
    scheduler.add_request(request("late", [1] * 12, deadline=0.5))
    step = scheduler.schedule()
    assert [chunk.request_id for chunk in step.chunks] == ["hog"]
    clock.now += 1.0
    scheduler.abort_requests(["hog"])
    step = scheduler.schedule()
    assert step.chunks == [] and "late" in step.finished_request_ids
    (delta,) = scheduler.update(step, executor.execute(step))
    assert (delta.request_id, delta.finish_reason) == ("late", "timeout")
    assert not scheduler.has_unfinished_requests() and kv.num_free_blocks == 4


def test_abort_between_schedule_and_update_drops_the_chunk() -> None:
    scheduler, kv, executor = make()
    scheduler.add_request(request("a", [1, 2, 3]))
    step = scheduler.schedule()
    output = executor.execute(step)
    scheduler.abort_requests(["a"])
    assert scheduler.update(step, output) == []
    assert kv.request_ids() == [] and not scheduler.has_unfinished_requests()


def test_full_waiting_queue_raises_queue_full() -> None:
    scheduler, _, _ = make(max_waiting_requests=2)
    scheduler.add_request(request("a", [1]))
    scheduler.add_request(request("b", [1]))
    with pytest.raises(QueueFullError, match="max_waiting_requests"):
        scheduler.add_request(request("c", [1]))


def test_requests_that_can_never_fit_are_rejected() -> None:
    scheduler, _, _ = make(num_blocks=4, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len=32"):
        scheduler.add_request(request("long", [1] * 33))
    with pytest.raises(ValueError, match="KV pool"):
        scheduler.add_request(request("big", [1] * 17))
    with pytest.raises(ValueError, match="empty"):
        scheduler.add_request(request("empty", []))


def test_abort_frees_blocks_in_every_state() -> None:
    scheduler, kv, executor = make(6, max_num_batched_tokens=4, max_num_seqs=2)
    scheduler.add_request(request("decoding", [1, 2], max_tokens=30))
    scheduler.add_request(request("prefilling", list(range(1, 12))))
    scheduler.add_request(request("waiting", [3, 4]))
    for _ in range(3):
        step = scheduler.schedule()
        scheduler.update(step, executor.execute(step))
    assert set(kv.request_ids()) == {"decoding", "prefilling"}
    deltas = scheduler.abort_requests(["waiting", "prefilling", "unknown"])
    assert [(d.request_id, d.finish_reason) for d in deltas] == [
        ("waiting", "abort"),
        ("prefilling", "abort"),
    ]
    assert kv.request_ids() == ["decoding"]
    step = scheduler.schedule()
    assert step.finished_request_ids == ["prefilling"]  # "waiting" never reached the executor
    scheduler.update(step, executor.execute(step))
    (delta,) = scheduler.abort_requests(["decoding"])
    assert delta.finish_reason == "abort"
    assert kv.request_ids() == [] and kv.num_free_blocks == 6
    assert not scheduler.has_unfinished_requests()


def test_abort_of_a_preempted_request_leaves_the_pool_whole() -> None:
    scheduler, kv, executor = make(6, max_num_seqs=2)
    scheduler.add_request(request("first", [1, 2, 3], max_tokens=20))
    scheduler.add_request(request("second", [4, 5, 6], max_tokens=20))
    while scheduler.stats().num_preemptions == 0:
        step = scheduler.schedule()
        scheduler.update(step, executor.execute(step))
    assert kv.request_ids() == ["first"]
    scheduler.abort_requests(["second", "first"])
    assert kv.num_free_blocks == 6 and not scheduler.has_unfinished_requests()


def test_logprobs_are_copied_to_the_delta_for_requests_that_asked() -> None:
    scheduler, _, _ = make()
    scheduler.add_request(request("lp", [1, 2], params=SamplingParams(logprobs=1)))
    scheduler.add_request(request("plain", [1, 2]))
    step = scheduler.schedule()
    top = [TopLogprobs([5], [-0.1])]
    output = StepOutput(step.step_id, ["lp", "plain"], [[5], [6]], [[-0.1], [-0.2]], [top, top])
    by_id = {d.request_id: d for d in scheduler.update(step, output)}
    assert by_id["lp"].logprobs == [-0.1] and by_id["lp"].top_logprobs == top
    assert by_id["plain"].logprobs is None
    assert by_id["lp"].num_prompt_tokens == 2


def test_stats_count_tokens_steps_and_requests() -> None:
    scheduler, _, executor = make(max_num_seqs=1)
    scheduler.add_request(request("a", [1, 2, 3], max_tokens=4, params=_no_eos(4)))
    scheduler.add_request(request("b", [1, 2], params=_no_eos(4)))
    step = scheduler.schedule()
    scheduler.update(step, executor.execute(step))
    stats = scheduler.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_steps) == (1, 1, 1)
    run_until_idle(scheduler, executor)
    stats = scheduler.stats()
    assert (stats.prompt_tokens_total, stats.generation_tokens_total) == (5, 8)
    assert stats.num_blocks_free == stats.num_blocks_total == 64


def _no_eos(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def test_speculative_outputs_reserve_lookahead_and_continue_as_one_chunk() -> None:
    scheduler, kv, _ = make(num_speculative_tokens=2)
    scheduler.add_request(request("spec", [1, 2, 3], max_tokens=10, params=_no_eos(10)))
    step = scheduler.schedule()
    assert len(kv.block_ids("spec")) == 2  # 3 tokens + 2 draft slots > one block of 4
    (delta,) = scheduler.update(step, StepOutput(step.step_id, ["spec"], [[7, 8, 9]]))
    assert delta.new_token_ids == [7, 8, 9]
    (chunk,) = scheduler.schedule().chunks
    assert (chunk.start_pos, chunk.token_ids, chunk.sample) == (3, [7, 8, 9], True)
    assert len(chunk.block_ids) * BS >= 6 + 2
