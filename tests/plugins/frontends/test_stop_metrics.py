"""A choice cut short by a stop string keeps the engine's metrics: ``Generation``
reads the aborted child's stream on until its last delta (bounded wait)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import pytest

from tokenloom.plugins.frontends import generation as generation_module
from tokenloom.plugins.frontends.generation import Generation
from tokenloom.protocols.components.engine import EngineClient
from tokenloom.protocols.outputs import EngineStats, FinishReason, RequestMetrics, TokenDelta
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.text.output_processor import OutputProcessor
from tokenloom.text.tokenizer import Tokenizer


class AbortingEngine(EngineClient):
    """One token per ``step_s``; an aborted stream ends with an "abort" delta carrying
    RequestMetrics (as the real engine's does), unless ``answers_abort`` is off."""

    def __init__(self, tokens: list[int], answers_abort: bool = True) -> None:
        self.tokens = tokens
        self.answers_abort = answers_abort
        self.aborted: list[str] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        start = request.arrival_time
        for i in range(request.params.max_tokens or 1):
            await asyncio.sleep(0.002)
            if self.answers_abort and request.request_id in self.aborted:
                metrics = RequestMetrics(start, start + 0.25, start + 0.5, start + 2.0, 1, 3)
                yield TokenDelta(request.request_id, [], FinishReason.ABORT, metrics=metrics)
                return
            yield TokenDelta(request.request_id, [self.tokens[i % len(self.tokens)]])

    async def abort(self, request_ids: Sequence[str]) -> None:
        self.aborted.extend(request_ids)

    async def stats(self) -> EngineStats:
        return EngineStats()

    @property
    def is_alive(self) -> bool:
        return True


@pytest.fixture(scope="module")
def tokenizer(tiny_model_factory) -> Tokenizer:  # type: ignore[no-untyped-def]
    return Tokenizer.from_dir(tiny_model_factory("llama"))


async def _finish(engine: AbortingEngine, tokenizer: Tokenizer) -> tuple[Generation, list]:
    ids = tokenizer.encode(" one two three four", add_special_tokens=False)
    engine.tokens = ids
    params = SamplingParams(max_tokens=400, stop=[" three"])
    prompt = tokenizer.encode("hello")
    gen = Generation(engine, OutputProcessor(tokenizer), "r1", "hello", prompt, params, [])
    updates = [u async for batch in gen.updates() for u in batch]
    return gen, updates


async def test_stopped_choice_gets_the_engines_metrics(tokenizer: Tokenizer) -> None:
    engine = AbortingEngine([])
    gen, updates = await _finish(engine, tokenizer)
    assert updates[-1].finish_reason == "stop"
    assert engine.aborted == ["r1"]
    metrics = gen.job_metrics()
    assert metrics is not None
    assert (metrics.queue_time, metrics.time_to_first_token, metrics.e2e_time) == (0.25, 0.5, 2.0)
    assert (metrics.num_preemptions, metrics.num_cached_tokens) == (1, 3)


async def test_an_engine_that_never_answers_the_abort_costs_a_bounded_wait(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(generation_module, "STOPPED_METRICS_WAIT_S", 0.1)
    started = time.monotonic()
    gen, updates = await _finish(AbortingEngine([], answers_abort=False), tokenizer)
    assert updates[-1].finish_reason == "stop"
    assert time.monotonic() - started < 0.5  # 400 tokens would take 0.8 s or more
    assert gen.job_metrics() is None
