"""A CPU stand-in for the executor that checks what a scheduler asks of the KV cache.

``FakeExecutor.execute`` honours the step contract without a model: it writes each
chunk's token ids into a simulated paged KV pool through the chunk's block table,
then "attends" by reading the whole history back through the same table, and
samples a token that is a deterministic function of that history. A scheduler or
KV manager that shares a block wrongly, overwrites a live block, skips positions or
forgets to send ``NewRequestData`` makes it raise ``AssertionError`` or changes the
generated tokens. ``PLACEHOLDER_TOKEN`` inputs take the request's last sampled
token, as a pipelining executor's do. Used by the scheduler tests; handy for
prototyping schedulers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenloom.protocols.components.scheduler import Scheduler
from tokenloom.protocols.outputs import TokenDelta
from tokenloom.protocols.step import PLACEHOLDER_TOKEN, StepInput, StepOutput

UNWRITTEN = -1


def next_token(history: list[int], vocab_size: int) -> int:
    """A token that depends on every token of ``history`` and on its order."""
    acc = len(history)
    for token in history:
        acc = (acc * 1_000_003 + token + 1) & 0xFFFFFFFF
    acc = ((acc ^ (acc >> 16)) * 0x45D9F3B) & 0xFFFFFFFF  # low bits of the LCG are weak
    return (acc ^ (acc >> 16)) % vocab_size


class FakeExecutor:
    supports_pipelining = True

    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 64) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.kv = [[UNWRITTEN] * block_size for _ in range(num_blocks)]
        self.known: set[str] = set()  # requests whose NewRequestData arrived
        self.dropped: set[str] = set()
        self.num_computed_tokens = 0
        self.last_sampled: dict[str, int] = {}

    def execute(self, step: StepInput) -> StepOutput:
        for request_id in step.finished_request_ids:
            self.known.discard(request_id)
            self.dropped.add(request_id)
            self.last_sampled.pop(request_id, None)
        for new in step.new_requests:
            assert new.request_id not in self.known, f"NewRequestData sent twice: {new.request_id}"
            assert new.request_id not in self.dropped, f"request id reused: {new.request_id}"
            self.known.add(new.request_id)
        assert step.num_tokens == sum(len(chunk.token_ids) for chunk in step.chunks)
        request_ids: list[str] = []
        token_ids: list[list[int]] = []
        bs = self.block_size
        for chunk in step.chunks:
            assert chunk.request_id in self.known, f"chunk for unknown {chunk.request_id}"
            table = chunk.block_ids
            end = chunk.start_pos + len(chunk.token_ids)
            assert len(chunk.token_ids) > 0 and len(table) * bs >= end, "table too short"
            for offset, token in enumerate(chunk.token_ids):
                pos = chunk.start_pos + offset
                if token == PLACEHOLDER_TOKEN:
                    assert offset == len(chunk.token_ids) - 1, "placeholder before a known token"
                    token = self.last_sampled[chunk.request_id]
                self.kv[table[pos // bs]][pos % bs] = token
            self.num_computed_tokens += len(chunk.token_ids)
            if not chunk.sample:
                continue
            history = [self.kv[table[pos // bs]][pos % bs] for pos in range(end)]
            assert UNWRITTEN not in history, f"{chunk.request_id} reads KV never written"
            request_ids.append(chunk.request_id)
            sampled = next_token(history, self.vocab_size)
            self.last_sampled[chunk.request_id] = sampled
            token_ids.append([sampled])
        return StepOutput(step.step_id, request_ids, token_ids)


@dataclass
class Generation:
    """What one request produced, gathered from its deltas."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


def collect(deltas: list[TokenDelta], into: dict[str, Generation]) -> None:
    for delta in deltas:
        generation = into.setdefault(delta.request_id, Generation())
        assert generation.finish_reason is None, f"delta after finish: {delta.request_id}"
        if delta.num_prompt_tokens:
            generation.num_prompt_tokens = delta.num_prompt_tokens
            generation.num_cached_tokens = delta.num_cached_tokens
        generation.token_ids.extend(delta.new_token_ids)
        generation.finish_reason = delta.finish_reason


def run_until_idle(
    scheduler: Scheduler,
    executor: FakeExecutor,
    max_steps: int = 100_000,
    results: dict[str, Generation] | None = None,
    pipelined: bool = False,
) -> dict[str, Generation]:
    """Step ``scheduler`` with ``executor`` until no request is left; returns what
    each request produced (added to ``results`` when given). ``pipelined`` schedules
    step N+1 before folding in step N's output, as the engine's async scheduling."""
    if results is None:
        results = {}
    in_flight: tuple[StepInput, StepOutput] | None = None
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests() and in_flight is None:
            return results
        step = scheduler.schedule()
        output = executor.execute(step)
        if not pipelined:
            collect(scheduler.update(step, output), results)
            continue
        if in_flight is not None:
            collect(scheduler.update(*in_flight), results)
        in_flight = (step, output) if step.chunks or step.finished_request_ids else None
    raise AssertionError(f"requests still unfinished after {max_steps} steps")
