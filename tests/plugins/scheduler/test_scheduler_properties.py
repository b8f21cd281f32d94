"""Random add / abort / step sequences through a scheduler and the paged KV manager.

After every operation the block pool must be consistent (reference counts match the
block tables, only cached blocks are shared, free + used = total, only running
requests hold blocks); every step must respect the budget, the sequence limit and
the block tables; every generated token must be the one the fake model computes
from the request's true history (so KV reuse, sharing and preemption are exact).
Every sequence also runs pipelined: step N+1 is scheduled before step N's output is
folded in (async scheduling), with placeholder inputs the fake executor resolves.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenloom.config import EngineConfig
from tokenloom.contrib.schedulers.static import StaticScheduler
from tokenloom.plugins.kv_cache.paged import PagedKVCache
from tokenloom.plugins.scheduler.batch_scheduler import BatchScheduler
from tokenloom.plugins.scheduler.continuous import ContinuousScheduler
from tokenloom.plugins.scheduler.fake_executor import FakeExecutor, next_token
from tokenloom.protocols.components.errors import QueueFullError
from tokenloom.protocols.outputs import TokenDelta
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.protocols.step import PLACEHOLDER_TOKEN, StepInput, StepOutput

VOCAB = 24  # small, so that EOS (0) comes up often
MAX_MODEL_LEN = 64
SHARED_PREFIXES = [[(g * 7 + i) % (VOCAB - 1) + 1 for i in range(24)] for g in range(3)]

add_op = st.tuples(
    st.just("add"),
    st.integers(1, 40),  # prompt length
    st.integers(1, 24),  # max_tokens
    st.integers(0, 2),  # priority
    st.integers(-1, 2),  # shared prefix group, -1 = none
    st.integers(0, 3),  # min_tokens
    st.integers(0, 2**16),  # seed of the prompt tail
    st.one_of(st.none(), st.integers(1, 30)),  # deadline, in steps
)
abort_op = st.tuples(st.just("abort"), st.integers(0, 40))
step_op = st.tuples(st.just("step"), st.integers(1, 4))
ops = st.lists(st.one_of(add_op, add_op, abort_op, step_op, step_op), min_size=4, max_size=50)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Harness:
    def __init__(
        self,
        scheduler: BatchScheduler,
        kv: PagedKVCache,
        config: EngineConfig,
        clock: FakeClock,
        pipelined: bool = False,
    ) -> None:
        self.pipelined = pipelined
        self.in_flight: tuple[StepInput, StepOutput] | None = None
        self.clock = clock
        self.scheduler = scheduler
        self.kv = kv
        self.config = config
        self.executor = FakeExecutor(kv.num_blocks, kv.block_size, VOCAB)
        self.history: dict[str, list[int]] = {}
        self.added: list[str] = []
        self.done: dict[str, str] = {}  # request id -> finish reason
        self.requests: dict[str, GenerateRequest] = {}

    def add(
        self, prompt: list[int], params: SamplingParams, priority: int, deadline: int | None
    ) -> None:
        request_id = f"r{len(self.added)}"
        request = GenerateRequest(
            request_id, prompt, params, [0], priority=priority, deadline=deadline
        )
        try:
            self.scheduler.add_request(request)
        except QueueFullError:
            return
        except ValueError:
            assert len(prompt) > self.kv.num_blocks * self.kv.block_size
            return
        self.added.append(request_id)
        self.history[request_id] = list(prompt)
        self.requests[request_id] = request

    def abort(self, index: int) -> None:
        if not self.added:
            return
        request_id = self.added[index % len(self.added)]
        self.fold(self.scheduler.abort_requests([request_id]))
        self.check_pool()

    def step(self) -> None:
        self.clock.now += 1.0
        step = self.scheduler.schedule()
        self.check_step(step)
        output = self.executor.execute(step)
        if not self.pipelined:
            self.fold(self.scheduler.update(step, output))
        else:
            if self.in_flight is not None:
                self.fold(self.scheduler.update(*self.in_flight))
            self.in_flight = (step, output)
        self.check_pool()

    def unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.in_flight is not None

    def drain(self) -> None:
        for _ in range(5000):
            if not self.unfinished():
                return
            if self.in_flight is not None and not self.scheduler.has_unfinished_requests():
                self.fold(self.scheduler.update(*self.in_flight))
                self.in_flight = None
                continue
            self.step()

    def fold(self, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            assert delta.request_id not in self.done
            history = self.history[delta.request_id]
            for token in delta.new_token_ids:
                assert token == next_token(history, VOCAB)
                history.append(token)
            if delta.finish_reason is not None:
                self.done[delta.request_id] = delta.finish_reason

    def check_step(self, step: StepInput) -> None:
        config = self.config
        ids = [chunk.request_id for chunk in step.chunks]
        assert len(ids) == len(set(ids)) <= config.max_num_seqs
        assert step.num_tokens <= config.max_num_batched_tokens
        for chunk in step.chunks:
            assert chunk.request_id not in self.done
            history = self.history[chunk.request_id]
            end = chunk.start_pos + len(chunk.token_ids)
            known = history[chunk.start_pos : end]
            assert chunk.token_ids[: len(known)] == known
            # Only a step in flight leaves tokens unknown: one, the chunk's last.
            unknown = chunk.token_ids[len(known) :]
            assert unknown == ([PLACEHOLDER_TOKEN] if self.pipelined and unknown else [])
            if not self.pipelined:
                assert chunk.sample == (end == len(history))
            assert len(chunk.block_ids) * self.kv.block_size >= end

    def check_pool(self) -> None:
        kv = self.kv
        holders = kv.request_ids()
        counts: Counter[int] = Counter()
        for request_id in holders:
            table = kv.block_ids(request_id)
            assert len(set(table)) == len(table)
            counts.update(table)
        for block in range(kv.num_blocks):
            assert kv.ref_count(block) == counts[block]
            if counts[block] > 1:
                assert kv.is_cached(block)
        num_unreferenced = sum(1 for block in range(kv.num_blocks) if counts[block] == 0)
        assert kv.num_free_blocks == num_unreferenced
        assert kv.num_free_blocks + kv.num_used_blocks == kv.num_blocks
        assert not set(holders) & set(self.done)
        running = {state.request_id for state in self.scheduler.running}
        assert set(holders) == running


SCHEDULERS = [ContinuousScheduler, StaticScheduler]


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("scheduler_cls", SCHEDULERS)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    operations=ops,
    num_blocks=st.integers(4, 32),
    block_size=st.sampled_from([1, 2, 4, 8]),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 48),
    caching=st.booleans(),
)
def test_random_operations_keep_the_pool_and_steps_consistent(
    scheduler_cls: type[BatchScheduler],
    pipelined: bool,
    operations: list[tuple],
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    budget: int,
    caching: bool,
) -> None:
    run_operations(
        scheduler_cls, operations, num_blocks, block_size, max_num_seqs, budget, caching, pipelined
    )


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("scheduler_cls", SCHEDULERS)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    operations=st.lists(st.one_of(add_op, add_op, add_op, step_op), min_size=6, max_size=30),
    num_blocks=st.integers(3, 12),
    max_num_seqs=st.integers(2, 6),
    caching=st.booleans(),
)
def test_random_operations_under_kv_pressure_preempt_and_stay_exact(
    scheduler_cls: type[BatchScheduler],
    pipelined: bool,
    operations: list[tuple],
    num_blocks: int,
    max_num_seqs: int,
    caching: bool,
) -> None:
    run_operations(scheduler_cls, operations, num_blocks, 4, max_num_seqs, 16, caching, pipelined)


def run_operations(
    scheduler_cls: type[BatchScheduler],
    operations: list[tuple],
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    budget: int,
    caching: bool,
    pipelined: bool = False,
) -> None:
    config = EngineConfig(
        max_model_len=MAX_MODEL_LEN,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        max_waiting_requests=12,
    )
    kv = PagedKVCache(config, num_blocks, block_size)
    clock = FakeClock()
    harness = Harness(scheduler_cls(config, kv, clock), kv, config, clock, pipelined)
    for op in operations:
        if op[0] == "add":
            _, length, max_tokens, priority, group, min_tokens, seed, deadline = op
            rng = random.Random(seed)
            prompt = SHARED_PREFIXES[group][:length] if group >= 0 else []
            prompt = prompt + [rng.randrange(1, VOCAB) for _ in range(length - len(prompt))]
            params = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens))
            harness.add(prompt, params, priority, deadline)
        elif op[0] == "abort":
            harness.abort(op[1])
        else:
            for _ in range(op[1]):
                harness.step()
    harness.drain()
    assert not harness.unfinished()
    assert set(harness.done) == set(harness.added)
    assert kv.request_ids() == [] and kv.num_free_blocks == num_blocks
    for request_id, reason in harness.done.items():
        request = harness.requests[request_id]
        total = len(harness.history[request_id])
        num_output = total - len(request.prompt_token_ids)
        if reason == "stop":
            assert harness.history[request_id][-1] == 0
            assert num_output >= request.params.min_tokens
        elif reason == "length":
            limit = min(MAX_MODEL_LEN, num_blocks * block_size)
            assert num_output == request.params.max_tokens or total >= limit
        elif reason == "timeout":
            assert request.deadline is not None
        else:
            assert reason == "abort"
