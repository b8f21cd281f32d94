"""``Generation`` in-process against a scripted EngineClient: timeouts, aborts on
close, stop strings, and failing every live request when the engine dies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from tokenloom.plugins.frontends.generation import Generation, LiveGenerations
from tokenloom.plugins.frontends.metrics import ServingMetrics
from tokenloom.protocols.components.engine import EngineClient
from tokenloom.protocols.components.errors import EngineDeadError
from tokenloom.protocols.outputs import EngineStats, FinishReason, TokenDelta
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.text.output_processor import OutputProcessor
from tokenloom.text.tokenizer import Tokenizer


class ScriptedEngine(EngineClient):
    """Each request gets ``params.max_tokens`` tokens, one per ``step_s``. Once not
    alive, every stream raises EngineDeadError, as ``AsyncEngineClient.mark_dead``
    makes them."""

    def __init__(self, tokens: list[int], step_s: float = 0.001) -> None:
        self.tokens = tokens
        self.step_s = step_s
        self.aborted: list[str] = []
        self.alive = True

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        limit = request.params.max_tokens or 1
        for i in range(limit):
            await asyncio.sleep(self.step_s)
            if not self.alive:
                raise EngineDeadError("engine-core exited with code -9")
            done = FinishReason.LENGTH if i + 1 == limit else None
            yield TokenDelta(request.request_id, [self.tokens[i % len(self.tokens)]], done)

    async def abort(self, request_ids: Sequence[str]) -> None:
        self.aborted.extend(request_ids)

    async def stats(self) -> EngineStats:
        return EngineStats()

    @property
    def is_alive(self) -> bool:
        return self.alive


@pytest.fixture(scope="module")
def tokenizer(tiny_model_factory) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_factory("llama"))


def _generation(engine, tokenizer, params, **options) -> Generation:
    ids = tokenizer.encode("hello")
    return Generation(engine, OutputProcessor(tokenizer), "r1", "hello", ids, params, [], **options)


async def _run(generation: Generation) -> dict[int, tuple[str, str | None]]:
    texts: dict[int, list[str]] = {}
    finish: dict[int, str | None] = {}
    async for updates in generation.updates():
        for u in updates:
            texts.setdefault(u.index, []).append(u.text)
            finish[u.index] = u.finish_reason
    return {i: ("".join(parts), finish[i]) for i, parts in texts.items()}


async def test_choices_finish_with_their_text_and_token_counts(tokenizer):
    ids = tokenizer.encode(" the quick brown fox", add_special_tokens=False)
    engine = ScriptedEngine(ids)
    generation = _generation(engine, tokenizer, SamplingParams(n=2, max_tokens=len(ids)))
    result = await _run(generation)
    expected = tokenizer.decode(ids)
    assert result == {0: (expected, "length"), 1: (expected, "length")}
    assert generation.num_generated_tokens == 2 * len(ids)
    assert engine.aborted == []


async def test_timeout_finishes_open_choices_and_aborts_them_in_the_engine(tokenizer):
    engine = ScriptedEngine(tokenizer.encode(" a b c", add_special_tokens=False), step_s=0.01)
    metrics = ServingMetrics()
    generation = _generation(
        engine, tokenizer, SamplingParams(max_tokens=1000), timeout_s=0.1, metrics=metrics
    )
    result = await asyncio.wait_for(_run(generation), 2)
    assert result[0][1] == "timeout"
    assert engine.aborted == ["r1"]
    assert metrics.requests_total == {"timeout": 1}


async def test_stop_string_finishes_the_choice_and_aborts_it(tokenizer):
    ids = tokenizer.encode(" one two three four", add_special_tokens=False)
    engine = ScriptedEngine(ids)
    params = SamplingParams(max_tokens=50, stop=[" three"])
    result = await _run(_generation(engine, tokenizer, params))
    assert result[0] == (" one two", "stop")
    await asyncio.sleep(0.01)
    assert "r1" in engine.aborted


async def test_closing_early_aborts_every_child(tokenizer):
    engine = ScriptedEngine([30, 31], step_s=0.01)
    generation = _generation(engine, tokenizer, SamplingParams(n=3, max_tokens=500))
    updates = generation.updates()
    await anext(updates)
    await updates.aclose()
    assert sorted(engine.aborted) == ["r1/0", "r1/1", "r1/2"]
    assert generation.finished


async def test_engine_death_fails_every_live_generation_and_empties_the_live_set(tokenizer):
    engine = ScriptedEngine([30], step_s=0.01)
    live = LiveGenerations(engine, tokenizer, eos_token_ids=[])
    params = SamplingParams(max_tokens=1000)
    generations = [live.new(f"r{i}", None, [30, 31], params) for i in range(3)]
    runs = [asyncio.create_task(_run(g)) for g in generations]
    await asyncio.sleep(0.05)
    assert len(live) == 3
    engine.alive = False
    results = await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 2)
    assert all(isinstance(r, EngineDeadError) for r in results)
    assert len(live) == 0
