"""Finishing an n-way request costs time linear in n (issue 15: at n = 5,000 the event
loop was blocked for 98 s): the processor reports only the completions a step
changed, and ``Generation`` counts its finished choices instead of scanning them."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator, Sequence

import pytest

from tokenloom.plugins.frontends.generation import Generation
from tokenloom.protocols.components.engine import EngineClient
from tokenloom.protocols.outputs import EngineStats, FinishReason, TokenDelta
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.text.output_processor import OutputProcessor
from tokenloom.text.tokenizer import Tokenizer


class _InstantEngine(EngineClient):
    """Every child gets ``max_tokens`` tokens at once, as fast as the loop runs."""

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        limit = request.params.max_tokens or 1
        for i in range(limit):
            await asyncio.sleep(0)
            yield TokenDelta(request.request_id, [30 + i % 3], "length" if i + 1 == limit else None)

    async def abort(self, request_ids: Sequence[str]) -> None:
        pass

    async def stats(self) -> EngineStats:
        return EngineStats()

    @property
    def is_alive(self) -> bool:
        return True


@pytest.fixture(scope="module")
def tokenizer(tiny_model_factory) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_factory("llama"))


def _seconds_to_finish(tokenizer: Tokenizer, n: int) -> float:
    async def run() -> float:
        params = SamplingParams(n=n, max_tokens=3)
        generation = Generation(
            _InstantEngine(), OutputProcessor(tokenizer), "r", "hi", [5, 6], params, []
        )
        started = time.perf_counter()
        finished = set()
        async for updates in generation.updates():
            finished.update(u.index for u in updates if u.finish_reason is not None)
        assert finished == set(range(n))
        return time.perf_counter() - started

    gc.collect()
    gc.disable()  # a collection landing in one run only would time the collector, not n
    try:
        return asyncio.run(run())
    finally:
        gc.enable()


def test_finishing_an_n_way_request_scales_linearly_in_n(tokenizer: Tokenizer) -> None:
    # the best of five interleaved pairs: a busy machine (another process on the CPU) once
    # stretched one run of the larger size to 9x the smaller's
    pairs = [
        (_seconds_to_finish(tokenizer, 500), _seconds_to_finish(tokenizer, 2000)) for _ in range(5)
    ]
    small, large = min(p[0] for p in pairs), min(p[1] for p in pairs)
    # 4x the choices: linear is ~4x; the quadratic path this replaces was ~16-30x.
    assert large / small < 7.0, (small, large)


def test_a_streaming_step_reports_only_the_completions_it_changed(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [5, 6], SamplingParams(n=4), [2])
    step = processor.process([TokenDelta("r/2", [30]), TokenDelta("r/0", [31])])
    assert [c.index for c in step.outputs[0].outputs] == [0, 2]
    for engine_id in ("r/0", "r/1", "r/2"):
        processor.process([TokenDelta(engine_id, [], FinishReason.LENGTH)])
    last = processor.process([TokenDelta("r/3", [32], FinishReason.LENGTH)]).outputs[0]
    assert last.finished and [c.index for c in last.outputs] == [0, 1, 2, 3]
    assert [c.token_ids for c in last.outputs] == [[31], [], [30], [32]]
