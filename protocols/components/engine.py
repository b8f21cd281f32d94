"""The engine, as its two callers see it: ``EngineCore`` is what the engine-core loop
(and the offline ``LLM``) drives in-process; ``EngineClient`` is a frontend's async
handle on an engine-core in another process."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tokenloom.protocols.control import Ready
    from tokenloom.protocols.outputs import EngineStats, TokenDelta
    from tokenloom.protocols.requests import GenerateRequest


class EngineCore(Protocol):
    """One engine, stepped by one caller: ``tokenloom.engine.loop.EngineLoop`` in the
    engine-core process, or ``LLM`` offline. The default is
    ``tokenloom.engine.engine_core.Engine`` (scheduler + KV cache + executor).

    Not thread-safe; every method is called from the caller's one thread. Only
    ``step`` may block (it waits for the device). A Protocol, so that test fakes
    satisfy it by shape.
    """

    def add_request(self, request: GenerateRequest) -> None:
        """Accept a request. Raises ``QueueFullError`` when the waiting queue is full
        and ValueError when the request can never run (e.g. longer than the model)."""
        ...

    def abort(self, request_ids: Sequence[str]) -> list[TokenDelta]:
        """Finish these requests now (unknown ids are ignored). Returns one delta with
        finish_reason "abort" per request that was live."""
        ...

    def step(self) -> list[TokenDelta]:
        """Run one iteration (schedule, execute, fold results in); returns the deltas
        it produced, possibly none. Blocks until the device is done."""
        ...

    def has_unfinished(self) -> bool:
        """True while any request waits or runs, or a launched step is not folded in."""
        ...

    def stats(self) -> EngineStats:
        """Counters for /metrics (cheap)."""
        ...

    def ready_info(self) -> Ready:
        """The start-up handshake the supervisor sends on: model, limits, EOS ids."""
        ...

    def shutdown(self) -> None:
        """Release devices and workers; called once, after the last step."""
        ...


class EngineClient(ABC):
    """The frontend's handle on the engine-core: async, one per frontend process."""

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Submit a request and yield its deltas until one has a finish_reason.
        Leaving the iterator early aborts the request in the engine. Raises
        ``EngineError(code, message)`` when the engine refuses it and
        ``EngineDeadError`` as soon as the engine-core process is found dead (both in
        ``protocols.components.errors``)."""

    @abstractmethod
    async def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests; their blocks are freed at the engine's next step."""

    @abstractmethod
    async def stats(self) -> EngineStats:
        """Current engine counters."""

    @property
    @abstractmethod
    def is_alive(self) -> bool:
        """False once the engine-core process is gone."""
