"""The harness every conformance suite drives: a scheduler, a KV manager, a fake model.

``run_operations`` feeds one random sequence of adds, aborts and steps through a
scheduler and a KV manager, with ``FakeExecutor`` standing in for the model: it
writes each chunk's tokens into a simulated paged pool through the chunk's block
table and samples a token that is a function of the whole history read back, so a
block shared or overwritten wrongly, a skipped position or a lost token changes the
output. After every operation the harness checks, through the public interfaces only:
- the step: request ids unique, at most ``max_num_seqs`` chunks and
  ``max_num_batched_tokens`` tokens, chunks only for live requests, known tokens
  equal to the request's true history, block tables long enough;
- the pool: no block twice in one table; a block in two tables only where both
  requests have identical tokens up to that block's end (prefix sharing); no
  finished request holds blocks; free + held <= total (and, for the reference
  ``paged`` manager, exact reference counts);
- every token equals the fake model's, every request finishes exactly once with a
  reason that fits, and when all are done the whole pool is free again.
With ``pipelined`` step N+1 is scheduled before step N's output is folded in (async
scheduling), with ``PLACEHOLDER_TOKEN`` inputs the fake executor resolves.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from tokenloom.config import EngineConfig
from tokenloom.plugins.scheduler.fake_executor import FakeExecutor, next_token
from tokenloom.protocols.components.errors import QueueFullError
from tokenloom.protocols.components.kv_cache import KVCacheManager
from tokenloom.protocols.components.scheduler import Scheduler
from tokenloom.protocols.outputs import FinishReason, TokenDelta
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.protocols.step import PLACEHOLDER_TOKEN, StepInput, StepOutput

VOCAB = 24  # small, so that EOS (0) comes up often
MAX_MODEL_LEN = 64
SHARED_PREFIXES = [[(g * 7 + i) % (VOCAB - 1) + 1 for i in range(24)] for g in range(3)]

SchedulerFactory = Callable[..., Scheduler]  # (config, kv_cache, clock=...) -> Scheduler
KVCacheFactory = Callable[..., KVCacheManager]  # (config, num_blocks, block_size) -> manager

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
operations = st.lists(
    st.one_of(add_op, add_op, abort_op, step_op, step_op), min_size=4, max_size=50
)
pressure_operations = st.lists(st.one_of(add_op, add_op, add_op, step_op), min_size=6, max_size=30)


class FakeClock:
    """A clock the test moves: one second per step."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """One scheduler, one KV manager and the fake executor, checked after each call."""

    def __init__(
        self,
        scheduler: Scheduler,
        kv: KVCacheManager,
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
        self.metrics_seen = 0

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
            assert len(prompt) > self.kv.num_blocks * self.kv.block_size, "refused a prompt"
            return
        self.added.append(request_id)
        self.history[request_id] = list(prompt)
        self.requests[request_id] = request

    def abort(self, index: int) -> None:
        if not self.added:
            return
        request_id = self.added[index % len(self.added)]
        deltas = self.scheduler.abort_requests([request_id])
        if request_id in self.done:
            assert deltas == [], "an abort of a finished request returned a delta"
        self.fold(deltas)
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

    def drain(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.unfinished():
                return
            if self.in_flight is not None and not self.scheduler.has_unfinished_requests():
                self.fold(self.scheduler.update(*self.in_flight))
                self.in_flight = None
                continue
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def fold(self, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            assert delta.request_id not in self.done, f"delta after finish: {delta.request_id}"
            history = self.history[delta.request_id]
            for token in delta.new_token_ids:
                assert token == next_token(history, VOCAB), "a token differs from the model's"
                history.append(token)
            if delta.finish_reason is not None:
                self.done[delta.request_id] = delta.finish_reason
                self.metrics_seen += delta.metrics is not None

    def check_step(self, step: StepInput) -> None:
        config = self.config
        ids = [chunk.request_id for chunk in step.chunks]
        assert len(ids) == len(set(ids)), "a request has two chunks in one step"
        assert len(ids) <= config.max_num_seqs, "more sequences than max_num_seqs"
        num_tokens = sum(len(chunk.token_ids) for chunk in step.chunks)
        assert num_tokens <= config.max_num_batched_tokens, "over the token budget"
        assert step.num_tokens == num_tokens, "StepInput.num_tokens is not the chunks' sum"
        for chunk in step.chunks:
            assert chunk.request_id not in self.done, "a chunk for a finished request"
            history = self.history[chunk.request_id]
            end = chunk.start_pos + len(chunk.token_ids)
            known = history[chunk.start_pos : end]
            assert chunk.token_ids[: len(known)] == known, "chunk tokens differ from history"
            # Only a step in flight leaves tokens unknown: one, the chunk's last.
            unknown = chunk.token_ids[len(known) :]
            assert unknown == ([PLACEHOLDER_TOKEN] if self.pipelined and unknown else [])
            if not self.pipelined:
                assert chunk.sample == (end == len(history)), "sample flag is wrong"
            assert len(chunk.block_ids) * self.kv.block_size >= end, "block table too short"

    def check_pool(self) -> None:
        kv = self.kv
        bs = kv.block_size
        owners: dict[int, tuple[str, int]] = {}  # block -> (a holder, index in its table)
        counts: Counter[int] = Counter()
        for request_id in self.added:
            table = kv.block_ids(request_id)
            if request_id in self.done:
                assert not table, f"finished {request_id} still holds blocks"
                continue
            assert len(set(table)) == len(table), f"a block twice in {request_id}'s table"
            counts.update(table)
            for index, block in enumerate(table):
                other = owners.setdefault(block, (request_id, index))
                if other[0] != request_id:  # shared: must be the same prefix block
                    end = (index + 1) * bs
                    assert other[1] == index, f"block {block} at two positions"
                    mine, theirs = self.history[request_id], self.history[other[0]]
                    assert len(mine) >= end and mine[:end] == theirs[:end], (
                        f"block {block} shared by {request_id} and {other[0]} with different tokens"
                    )
        assert kv.num_free_blocks + len(counts) <= kv.num_blocks, "free + held > total"
        exact = getattr(kv, "ref_count", None)  # the reference manager tells more
        if exact is not None:
            for block in range(kv.num_blocks):
                assert exact(block) == counts[block], f"ref count of block {block}"
        running = getattr(self.scheduler, "running", None)
        if running is not None:
            holders = {rid for rid in self.added if rid not in self.done and kv.block_ids(rid)}
            assert holders == {state.request_id for state in running}, "holders != running"

    def check_finished(self) -> None:
        """After ``drain``: every request finished once, fittingly, and the pool is free."""
        assert not self.unfinished()
        assert set(self.done) == set(self.added), "a request never finished"
        assert self.kv.num_free_blocks == self.kv.num_blocks, "blocks leaked"
        limit = min(MAX_MODEL_LEN, self.kv.num_blocks * self.kv.block_size)
        for request_id, reason in self.done.items():
            request = self.requests[request_id]
            total = len(self.history[request_id])
            num_output = total - len(request.prompt_token_ids)
            if reason == FinishReason.STOP:
                assert self.history[request_id][-1] == 0, "stop without EOS"
                assert num_output >= request.params.min_tokens, "stopped before min_tokens"
            elif reason == FinishReason.LENGTH:
                assert num_output == request.params.max_tokens or total >= limit
            elif reason == FinishReason.TIMEOUT:
                assert request.deadline is not None, "timeout without a deadline"
            else:
                assert reason == FinishReason.ABORT, f"unexpected finish reason {reason!r}"


def run_operations(
    scheduler_factory: SchedulerFactory,
    kv_factory: KVCacheFactory,
    ops: list[tuple[Any, ...]],
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    budget: int,
    caching: bool,
    pipelined: bool = False,
) -> Harness:
    """Run ``ops`` (drawn from ``operations``) to the end, checking as it goes."""
    config = EngineConfig(
        max_model_len=MAX_MODEL_LEN,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        max_waiting_requests=12,
    )
    kv = kv_factory(config, num_blocks, block_size)
    clock = FakeClock()
    harness = Harness(scheduler_factory(config, kv, clock=clock), kv, config, clock, pipelined)
    for op in ops:
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
    harness.check_finished()
    return harness
