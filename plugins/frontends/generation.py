"""One client request in flight, shared by the frontends: engine children in, choice
updates out.

``Generation`` expands the request through the ``OutputProcessor`` (n > 1 becomes n
engine requests), pumps every child's ``EngineClient.generate`` stream into one
queue, runs the deltas through the processor (detokenization, stop strings) and
yields ``ChoiceUpdate`` batches: the new text and token ids of each choice, and its
finish reason. Closing it early (client gone) aborts every unfinished child in the
engine. A per-request timeout finishes the unfinished choices with reason "timeout".

A choice cut short by a stop string is finished for the client at once and aborted
in the engine; its stream is still read until the engine's last delta, which carries
the request's ``RequestMetrics``: after the last choice finished, ``updates()`` waits
for those last deltas (at most ``STOPPED_METRICS_WAIT_S``) before it ends, so the
job's metrics and ``/metrics`` include stopped choices.

A generation may hold an admission ``Reservation`` for its sequences: each choice
gives its one back when it finishes, ``close`` gives back the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tokenloom.plugins.frontends.admission import Admission, Reservation
from tokenloom.plugins.frontends.metrics import ServingMetrics
from tokenloom.protocols.components.engine import EngineClient
from tokenloom.protocols.components.errors import EngineDeadError
from tokenloom.protocols.jobs import JobMetrics
from tokenloom.protocols.outputs import FinishReason, RequestMetrics, TokenDelta, TopLogprobs
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.text.output_processor import OutputProcessor
from tokenloom.text.request_output import merge_metrics

_TIMEOUT = object()  # queue sentinel: the request's timeout expired
# Longest wait, after the last choice finished, for the engine's last delta of the
# choices a stop string finished (their abort's answer, one engine step away).
STOPPED_METRICS_WAIT_S = 1.0


@dataclass(slots=True)
class ChoiceUpdate:
    index: int
    text: str  # newly decoded text
    token_ids: list[int]  # newly sampled ids
    finish_reason: str | None = None
    logprobs: list[float] | None = None  # one per token in token_ids
    top_logprobs: list[TopLogprobs] | None = None


class _Child:
    __slots__ = (
        "request", "index", "text_len", "num_tokens", "finished", "engine_done", "last_time",
        "task",
    )  # fmt: skip

    def __init__(self, request: GenerateRequest, index: int) -> None:
        self.request = request
        self.index = index
        self.text_len = 0
        self.num_tokens = 0
        self.finished = False  # the client saw its finish reason
        self.engine_done = False  # the engine no longer runs it
        self.last_time = 0.0
        self.task: asyncio.Task[None] | None = None


class Generation:
    """Runs one request; iterate ``updates()`` once, then read the token counts."""

    def __init__(
        self,
        engine: EngineClient,
        processor: OutputProcessor,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: list[int],
        priority: int = 0,
        timeout_s: float | None = None,
        metrics: ServingMetrics | None = None,
        live: LiveGenerations | None = None,
        reservation: Reservation | None = None,
        tenant: str = "",
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.engine = engine
        self.reservation = reservation
        self.processor = processor
        self.request_id = request_id
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.live = live
        self.arrival = time.monotonic()
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_cached_tokens = 0
        self.first_token_time: float | None = None
        self.engine_metrics: list[RequestMetrics] = []  # from each child's last delta
        requests = processor.add_request(
            request_id, prompt, prompt_token_ids, params, eos_token_ids,
            priority=priority, arrival_time=self.arrival, deadline=timeout_s,
            tenant=tenant, metadata=metadata,
        )  # fmt: skip
        self._children = {r.request_id: _Child(r, i) for i, r in enumerate(requests)}
        self._closed = False
        self._num_finished = 0  # children with child.finished: ``finished`` in O(1)
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._background: set[asyncio.Task[None]] = set()

    @property
    def num_generated_tokens(self) -> int:
        return sum(child.num_tokens for child in self._children.values())

    @property
    def finished(self) -> bool:
        return self._num_finished == len(self._children)

    def job_metrics(self) -> JobMetrics | None:
        """The engine's timings of this request (see ``job_metrics``)."""
        return job_metrics(self.engine_metrics)

    async def updates(self) -> AsyncIterator[list[ChoiceUpdate]]:
        """Yield batches of choice updates until every choice finished. Raises the
        engine client's errors (EngineError, EngineDeadError) as they come; the client
        fails every pending stream when the engine dies."""
        loop = asyncio.get_running_loop()
        timer = None
        if self.timeout_s is not None:
            timer = loop.call_later(self.timeout_s, self._queue.put_nowait, _TIMEOUT)
        if self.live is not None:
            self.live.add(self)
        for child in self._children.values():
            child.task = asyncio.create_task(self._pump(child))
        try:
            while not self.finished:
                item = await self._queue.get()
                if item is _TIMEOUT:
                    yield self._finish_unfinished(FinishReason.TIMEOUT)
                    return
                if isinstance(item, BaseException):
                    raise item
                batch = self._process(item)
                if batch:
                    yield batch
            await self._await_stopped()
        finally:
            if timer is not None:
                timer.cancel()
            if self.live is not None:
                self.live.discard(self)
            await self.close()

    async def close(self) -> None:
        """Abort every unfinished child in the engine and drop its processor state.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        live = [cid for cid, child in self._children.items() if not child.engine_done]
        for child in self._children.values():
            child.engine_done = True
            if child.task is not None and not child.task.done():
                child.task.cancel()
        self._finish_unfinished(FinishReason.ABORT)
        self.processor.abort_request(self.request_id)  # forget it, even if never started
        if self.reservation is not None:
            self.reservation.release()
        if live and self.engine.is_alive:
            with contextlib.suppress(EngineDeadError):
                await self.engine.abort(live)
        if self.metrics is not None and self.first_token_time is not None:
            self.metrics.e2e.observe(time.monotonic() - self.arrival)

    async def _pump(self, child: _Child) -> None:
        stream = self.engine.generate(child.request)
        try:
            async for delta in stream:
                self._queue.put_nowait((child, delta))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # EngineError, EngineDeadError: the consumer raises
            self._queue.put_nowait(exc)
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    def _process(self, item: tuple[_Child, TokenDelta]) -> list[ChoiceUpdate]:
        child, delta = item
        if delta.metrics is not None:
            self.engine_metrics.append(delta.metrics)
            if self.metrics is not None:
                self.metrics.observe_engine_metrics(delta.metrics)
        if child.finished:
            return []  # e.g. the engine's "abort" after a stop string matched
        if delta.new_token_ids:
            self._observe_tokens(child, time.monotonic(), len(delta.new_token_ids))
        if delta.num_prompt_tokens:
            self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.finish_reason is not None:
            child.engine_done = True
        update = self._fold(child, delta)
        return [update] if update is not None else []

    def _fold(self, child: _Child, delta: TokenDelta) -> ChoiceUpdate | None:
        """Run one delta through the processor; the choice's update, if any."""
        child.num_tokens += len(delta.new_token_ids)
        result = self.processor.process([delta])
        text = ""
        finish = None
        for output in result.outputs:
            for completion in output.outputs:
                if completion.index == child.index:
                    text = completion.text[child.text_len :]
                    child.text_len = len(completion.text)
                    finish = completion.finish_reason
        if result.abort_ids:
            self._abort_soon(result.abort_ids)
        if finish is not None:
            child.finished = True
            self._num_finished += 1
            self._record_finished(finish)
        if not (text or delta.new_token_ids or finish):
            return None
        return ChoiceUpdate(
            child.index, text, delta.new_token_ids, finish, delta.logprobs, delta.top_logprobs
        )

    def _finish_unfinished(self, reason: str) -> list[ChoiceUpdate]:
        """Finish the choices still open with ``reason`` (their held-back text too)."""
        updates = []
        for child in self._children.values():
            if child.finished:
                continue
            update = self._fold(child, TokenDelta(child.request.request_id, [], reason))
            if not child.finished:  # the processor had forgotten it already
                child.finished = True
                self._num_finished += 1
                self._record_finished(reason)
            updates.append(update or ChoiceUpdate(child.index, "", [], reason))
        return updates

    async def _await_stopped(self) -> None:
        """Every choice finished: read the last deltas still on their way (the
        engine's answer to a stop string's abort), for their metrics; bounded."""
        pumps = [c.task for c in self._children.values() if c.task and not c.task.done()]
        if pumps and self.engine.is_alive:
            await asyncio.wait(pumps, timeout=STOPPED_METRICS_WAIT_S)
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, tuple):
                self._process(item)  # a finished child's: keeps its metrics only

    def _abort_soon(self, request_ids: list[str]) -> None:
        """Abort children the processor finished (a stop string); their pumps read on
        until the engine's last delta, whose metrics ``_await_stopped`` keeps."""
        for request_id in request_ids:
            child = self._children.get(request_id)
            if child is None:
                continue
            child.engine_done = True
        if self.engine.is_alive:
            task = asyncio.get_running_loop().create_task(self.engine.abort(request_ids))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _observe_tokens(self, child: _Child, now: float, n_new: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = now
            if self.metrics is not None:
                self.metrics.ttft.observe(now - self.arrival)
        elif self.metrics is not None and child.last_time:
            gap = (now - child.last_time) / n_new
            for _ in range(n_new):
                self.metrics.itl.observe(gap)
        child.last_time = now

    def _record_finished(self, reason: str) -> None:
        if self.reservation is not None:
            self.reservation.release(1)
        if self.metrics is not None and self.finished:
            self.metrics.record_finished(reason, self.num_prompt_tokens, self.num_generated_tokens)


def job_metrics(parts: list[RequestMetrics]) -> JobMetrics | None:
    """Engine requests' timings merged (choices, prompts of one request) as
    durations, the arrival as Unix time; None when the engine sent none."""
    merged = merge_metrics(parts)
    if merged is None:
        return None
    unix_arrival = time.time() - (time.monotonic() - merged.arrival_time)
    return JobMetrics(
        arrival_time=unix_arrival,
        queue_time=merged.queue_time,
        time_to_first_token=merged.time_to_first_token,
        e2e_time=merged.e2e_time,
        num_preemptions=merged.num_preemptions,
        num_cached_tokens=merged.num_cached_tokens,
    )


class LiveGenerations:
    """The requests a frontend has in flight: starts each with the frontend's shared
    output processor, EOS ids, timeout and metrics, and lets shutdown wait for them
    to drain. A dead engine needs nothing here: the engine client fails every
    pending stream with EngineDeadError, which each ``updates()`` raises.

    With an ``admission``, ``reserve`` holds a request's sequences before any work is
    done for it (raising ``QueueFullError`` at once when they do not fit), and ``new``
    without a reservation reserves ``params.n`` itself."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Any,
        eos_token_ids: list[int],
        timeout_s: float | None = None,
        metrics: ServingMetrics | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.engine = engine
        self.admission = admission
        self.processor = OutputProcessor(tokenizer)
        self.eos_token_ids = eos_token_ids
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.generations: set[Generation] = set()

    def __len__(self) -> int:
        return len(self.generations)

    def new(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        reservation: Reservation | None = None,
        tenant: str = "",
        metadata: dict[str, str] | None = None,
    ) -> Generation:
        """A generation that joins the live set once its ``updates()`` starts; it
        gives back ``reservation`` (or one it makes for ``params.n``) as it ends."""
        if reservation is None and self.admission is not None:
            reservation = self.admission.reserve(params.n)
        return Generation(
            self.engine, self.processor, request_id, prompt, prompt_token_ids, params,
            self.eos_token_ids, priority, self.timeout_s, self.metrics, self, reservation,
            tenant, metadata,
        )  # fmt: skip

    def reserve(self, num_sequences: int) -> Reservation | None:
        """Hold ``num_sequences`` of the admission (None without one); raises
        ``QueueFullError`` when they do not fit."""
        return None if self.admission is None else self.admission.reserve(num_sequences)

    def add(self, generation: Generation) -> None:
        self.generations.add(generation)

    def discard(self, generation: Generation) -> None:
        self.generations.discard(generation)

    async def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the live requests to finish; True if they did."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while self.generations and loop.time() < end:
            await asyncio.sleep(0.05)
        return not self.generations
