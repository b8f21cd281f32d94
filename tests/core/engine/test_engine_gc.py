"""The served engine loop runs with rare full GC passes (issue 16) and gives the
process its collector settings back when it ends."""

from __future__ import annotations

import asyncio
import gc

import pytest
import zmq
import zmq.asyncio

from tokenloom.engine import loop as engine_loop
from tokenloom.engine.loop import ENGINE_GC_THRESHOLDS, engine_gc


@pytest.fixture(autouse=True)
def python_defaults():
    """Python's default thresholds (another test may have tuned this process's)."""
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_engine_gc_freezes_start_up_and_restores_on_exit() -> None:
    before = gc.get_threshold()
    assert before != ENGINE_GC_THRESHOLDS
    with engine_gc():
        assert gc.get_threshold() == ENGINE_GC_THRESHOLDS
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_run_engine_loop_serves_under_engine_gc(monkeypatch, tmp_path) -> None:
    seen: list[tuple[int, int, int]] = []

    async def run(self: engine_loop.EngineLoop) -> None:
        seen.append(gc.get_threshold())

    monkeypatch.setattr(engine_loop.EngineLoop, "run", run)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind(f"ipc://{tmp_path}/in")
        push.bind(f"ipc://{tmp_path}/out")
        try:
            await engine_loop.run_engine_loop(object(), pull, push)  # type: ignore[arg-type]
        finally:
            ctx.destroy(linger=0)

    before = gc.get_threshold()
    asyncio.run(main())
    assert seen == [ENGINE_GC_THRESHOLDS]
    assert gc.get_threshold() == before
