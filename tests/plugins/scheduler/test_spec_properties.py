"""Speculative decoding through the scheduler: random drafts, random rejections,
aborts and preemption never leak a KV block or change a token.

A fake executor verifies each chunk's drafts against the fake model of
``fake_executor`` (reading the history back through the block table, so a draft
position written into a wrong block shows), rejects some correct drafts on
purpose, and proposes drafts that are partly right and partly random. The
harness of ``tokenloom.testing`` checks the pool after every operation and
that every delivered token is the fake model's next token.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenloom.config import EngineConfig
from tokenloom.contrib.schedulers.static import StaticScheduler
from tokenloom.plugins.kv_cache.paged import PagedKVCache
from tokenloom.plugins.scheduler.batch_scheduler import BatchScheduler
from tokenloom.plugins.scheduler.continuous import ContinuousScheduler
from tokenloom.plugins.scheduler.fake_executor import UNWRITTEN, FakeExecutor, next_token
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.protocols.step import PLACEHOLDER_TOKEN, StepInput, StepOutput
from tokenloom.testing.harness import (
    MAX_MODEL_LEN,
    SHARED_PREFIXES,
    VOCAB,
    FakeClock,
    Harness,
    abort_op,
    add_op,
    step_op,
)


class SpecFakeExecutor(FakeExecutor):
    """``FakeExecutor`` that verifies drafts and proposes new ones."""

    def __init__(self, num_blocks: int, block_size: int, k: int, seed: int) -> None:
        super().__init__(num_blocks, block_size, VOCAB)
        self.k = k
        self.rng = random.Random(seed)
        self.histories: dict[str, list[int]] = {}
        self.num_verified = 0

    def execute(self, step: StepInput) -> StepOutput:
        for new in step.new_requests:
            self.histories[new.request_id] = list(new.prompt_token_ids)
        plain = [c for c in step.chunks if not c.num_draft_tokens]
        output = super().execute(StepInput(step.step_id, plain, step.new_requests,
                                           step.finished_request_ids,
                                           sum(len(c.token_ids) for c in plain)))  # fmt: skip
        by_id = dict(zip(output.request_ids, output.token_ids, strict=True))
        for chunk in step.chunks:
            if chunk.num_draft_tokens:
                by_id[chunk.request_id] = self._verify(chunk)
        ids = [c.request_id for c in step.chunks if c.sample]
        tokens = [by_id[r] for r in ids]
        drafts = []
        for request_id, new_ids in zip(ids, tokens, strict=True):
            history = self.histories[request_id]
            history += new_ids
            drafts.append(self._propose(history))
        return StepOutput(step.step_id, ids, tokens, draft_token_ids=drafts)

    def _verify(self, chunk) -> list[int]:
        assert chunk.sample and chunk.request_id in self.known
        bs = self.block_size
        table = chunk.block_ids
        num = len(chunk.token_ids)
        end = chunk.start_pos + num
        assert len(table) * bs >= end, "table too short for the drafts"
        for offset, token in enumerate(chunk.token_ids):
            assert token != PLACEHOLDER_TOKEN, "placeholder in a chunk with drafts"
            pos = chunk.start_pos + offset
            self.kv[table[pos // bs]][pos % bs] = token
        self.num_computed_tokens += num
        self.num_verified += 1
        known_end = end - chunk.num_draft_tokens
        drafts = chunk.token_ids[num - chunk.num_draft_tokens :]
        out = []
        for j in range(chunk.num_draft_tokens + 1):
            history = [self.kv[table[pos // bs]][pos % bs] for pos in range(known_end + j)]
            assert UNWRITTEN not in history
            target = next_token(history, VOCAB)
            if j < len(drafts) and drafts[j] == target and self.rng.random() < 0.8:
                out.append(target)  # accepted (a fifth of right drafts are rejected anyway)
                continue
            out.append(target)  # the correction, or the bonus token
            break
        return out

    def _propose(self, history: list[int]) -> list[int]:
        drafts: list[int] = []
        for _ in range(self.rng.randint(0, self.k)):
            right = next_token(history + drafts, VOCAB)
            drafts.append(right if self.rng.random() < 0.7 else self.rng.randrange(VOCAB))
        return drafts


class SpecHarness(Harness):
    """The harness, with the pool that speculation leaves: the scheduler keeps
    ``num_speculative_tokens`` slots in reserve for the drafts."""

    def add(self, prompt: list[int], params: SamplingParams, priority: int, deadline) -> None:
        pool = self.kv.num_blocks * self.kv.block_size - self.config.num_speculative_tokens
        if len(prompt) > pool:  # refused at add_request: the drafts' slots would not fit
            with pytest.raises(ValueError, match="KV pool"):
                self.scheduler.add_request(GenerateRequest("refused", prompt, params, [0]))
            return
        super().add(prompt, params, priority, deadline)

    def check_finished(self) -> None:
        assert not self.unfinished()
        assert set(self.done) == set(self.added), "a request never finished"
        assert self.kv.num_free_blocks == self.kv.num_blocks, "blocks leaked"
        pool = self.kv.num_blocks * self.kv.block_size - self.config.num_speculative_tokens
        for request_id, reason in self.done.items():
            request = self.requests[request_id]
            total = len(self.history[request_id])
            num_output = total - len(request.prompt_token_ids)
            if reason == "length":
                assert num_output == request.params.max_tokens or total >= min(MAX_MODEL_LEN, pool)
            elif reason == "stop":
                assert self.history[request_id][-1] == 0
                assert num_output >= request.params.min_tokens

    def check_step(self, step: StepInput) -> None:
        stripped = []
        for chunk in step.chunks:
            k = chunk.num_draft_tokens
            if k:
                assert chunk.sample  # (pipelined too, when nothing is pending)
                assert 0 < k <= self.config.num_speculative_tokens
                end = chunk.start_pos + len(chunk.token_ids)
                assert len(chunk.block_ids) * self.kv.block_size >= end
                assert end <= MAX_MODEL_LEN
                chunk = type(chunk)(chunk.request_id, chunk.token_ids[:-k], chunk.start_pos,
                                    chunk.block_ids, chunk.sample)  # fmt: skip
            stripped.append(chunk)
        assert step.num_tokens == sum(len(c.token_ids) for c in step.chunks)
        assert step.num_tokens <= self.config.max_num_batched_tokens
        known = sum(len(c.token_ids) for c in stripped)
        super().check_step(StepInput(step.step_id, stripped, num_tokens=known))


def run_spec_operations(
    scheduler_cls: type[BatchScheduler],
    operations: list[tuple],
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    budget: int,
    k: int,
    pipelined: bool,
    caching: bool = True,
) -> SpecHarness:
    config = EngineConfig(
        max_model_len=MAX_MODEL_LEN,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        max_waiting_requests=12,
        num_speculative_tokens=k,
    )
    kv = PagedKVCache(config, num_blocks, block_size)
    clock = FakeClock()
    harness = SpecHarness(scheduler_cls(config, kv, clock), kv, config, clock, pipelined)
    harness.executor = SpecFakeExecutor(num_blocks, block_size, k, seed=len(operations))
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
    harness.check_finished()
    assert kv.request_ids() == []
    return harness


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("scheduler_cls", [ContinuousScheduler, StaticScheduler])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    operations=st.lists(st.one_of(add_op, add_op, abort_op, step_op, step_op), max_size=40),
    num_blocks=st.integers(6, 32),
    block_size=st.sampled_from([1, 2, 4, 8]),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 48),
    k=st.integers(1, 5),
    caching=st.booleans(),
)
def test_random_drafts_rejections_aborts_and_preemption_keep_blocks_and_tokens_exact(
    scheduler_cls: type[BatchScheduler],
    pipelined: bool,
    operations: list[tuple],
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    budget: int,
    k: int,
    caching: bool,
) -> None:
    run_spec_operations(
        scheduler_cls,
        operations,
        num_blocks,
        block_size,
        max_num_seqs,
        budget,
        k,
        pipelined,
        caching,
    )


def test_drafts_are_verified_and_counted() -> None:
    ops = [("add", 12, 24, 0, -1, 0, seed, None) for seed in range(4)] + [("step", 4)] * 30
    harness = run_spec_operations(ContinuousScheduler, ops, 64, 4, 4, 64, 4, False)
    scheduler = harness.scheduler
    assert harness.executor.num_verified == scheduler.spec_verify_steps > 10
    assert 0 < scheduler.spec_accepted_total < scheduler.spec_proposed_total
    assert set(harness.done.values()) <= {"length", "stop"}
