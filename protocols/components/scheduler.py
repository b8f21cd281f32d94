"""The scheduler interface: which requests compute which tokens, step by step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenloom.protocols.outputs import EngineStats, TokenDelta
    from tokenloom.protocols.requests import GenerateRequest
    from tokenloom.protocols.step import StepInput, StepOutput


class Scheduler(ABC):
    """Decides, each step, which requests compute which tokens.

    Constructed as ``factory(config: EngineConfig, kv_cache: KVCacheManager, clock:
    Callable[[], float] = time.monotonic)``; the engine passes ``clock`` by keyword
    (its own clock: ``time.monotonic`` in production, a fake one in tests), the time
    scale of ``GenerateRequest.arrival_time``, deadlines and ``RequestMetrics``.
    Lives in the engine-core process; its methods are called by the engine only,
    never concurrently. It must not block, touch the GPU, or allocate per token
    beyond the lists it returns. It owns stopping on token ids (EOS,
    stop_token_ids, max_tokens, model length); stop strings are matched by the
    frontend, which then aborts the request.

    Request lifecycle: ``add_request`` queues it (waiting) -> a ``schedule`` gives it
    blocks from the KV manager and its first chunk (running; the step's
    ``new_requests`` carries its ``NewRequestData`` once, ever) -> each later
    ``schedule`` gives it its next chunk: the rest of its prompt in chunks under the
    token budget, then one token per step -> ``update`` appends the sampled tokens
    and finishes it when a stop rule fires (its blocks freed, its id listed in the
    next step's ``finished_request_ids`` so the executor drops its state). Under KV
    pressure a running request may be preempted: its blocks are freed and it waits
    again, to be recomputed from its prompt and output so far. ``abort_requests``
    and deadlines finish a request in any state.

    Async scheduling (the engine's ``async_scheduling``): the engine may call
    ``schedule`` for step N+1 before ``update`` for step N. A chunk that reaches a
    request's last known token samples one token, which stays pending until that
    step's ``update``; a later chunk of the request that covers the pending
    position carries ``PLACEHOLDER_TOKEN`` there (``protocols.step``), which the
    executor replaces on the device. ``update`` is called for every step with
    chunks or finished ids, in step order, exactly once. A request that finishes
    (stop, abort, timeout) while a later step of it is in flight loses that step's
    token: ``update`` ignores chunks of requests that are no longer running, and a
    request id may be reused (abort, resubmit) while an old step of it is in
    flight. A request must not be started or resumed while it has a pending token.
    Called alternately (synchronous engine), there is never a pending token at
    ``schedule``.

    Metrics: the last delta of each request (finish_reason set) should carry its
    ``RequestMetrics`` (times on ``clock``); ``tokenloom.testing``'s
    ``SchedulerConformance`` checks it, with ``reports_metrics = False`` to opt out.

    Writing a policy: subclass ``tokenloom.plugins.scheduler.batch_scheduler.
    BatchScheduler`` and override its public extension points (``priority(state,
    now)`` with ``reprioritize_interval``, ``choose_victim(candidates)``,
    ``admit(budget)`` with ``start``, ``requeue``/``unqueue``/``num_queued``); see
    ``protocols/README.md`` ("Writing a scheduler") and ``examples/plugin_package``.
    """

    @abstractmethod
    def add_request(self, request: GenerateRequest) -> None:
        """Queue a request (its ``tenant``, ``metadata`` and ``priority`` are the
        policy's to use). Raises QueueFullError when the waiting queue is full, and
        ValueError when it can never fit (prompt longer than the model length or
        the KV pool)."""

    @abstractmethod
    def abort_requests(self, request_ids: Iterable[str]) -> list[TokenDelta]:
        """Finish these requests now (unknown ids are ignored) and free their blocks.
        Returns one delta with finish_reason "abort" per request that was live."""

    @abstractmethod
    def schedule(self) -> StepInput:
        """Build the next step: at most ``max_num_seqs`` chunks (one per request) and
        ``max_num_batched_tokens`` tokens, each chunk's ``block_ids`` covering its
        positions. Returns a StepInput with no chunks when idle."""

    @abstractmethod
    def update(self, step: StepInput, output: StepOutput) -> list[TokenDelta]:
        """Fold the executor's output into the requests: append tokens, finish those
        that stop, free their blocks. Returns the deltas to emit."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """Counters for /metrics (cheap: called at most a few times a second)."""
