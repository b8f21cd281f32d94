"""The choices of one OpenAI request: its generations' updates merged as they come
(tagged with the prompt's index), closed together, and their usage and engine metrics
summed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import msgspec

from tokenloom.plugins.frontends.generation import ChoiceUpdate, Generation, job_metrics
from tokenloom.plugins.frontends.openai import formatting as fmt

Merged = AsyncGenerator[tuple[int, list[ChoiceUpdate]], None]  # (prompt index, updates)


def usage(generations: list[Generation]) -> dict[str, Any]:
    return fmt.usage(
        sum(g.num_prompt_tokens for g in generations),
        sum(g.num_generated_tokens for g in generations),
        sum(g.num_cached_tokens for g in generations),
    )


def engine_metrics(generations: list[Generation]) -> dict[str, Any] | None:
    """The "metrics" extra: the engine's timings, merged over every choice."""
    merged = job_metrics([m for g in generations for m in g.engine_metrics])
    return None if merged is None else msgspec.structs.asdict(merged)


async def close_all(merged: Merged, generations: list[Generation]) -> None:
    await merged.aclose()
    for generation in generations:  # also those whose updates() never started
        await generation.close()


async def chain(first: tuple[int, list[ChoiceUpdate]], rest: Merged) -> Merged:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def merge(generations: list[Generation]) -> Merged:
    """The updates of every generation, tagged with its index, as they come."""
    if len(generations) == 1:
        updates = generations[0].updates()
        try:
            async for batch in updates:
                yield 0, batch
        finally:
            await updates.aclose()
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for batch in generation.updates():
                queue.put_nowait((index, batch))
            queue.put_nowait((index, None))
        except Exception as exc:
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item[1] is None:
                remaining -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
