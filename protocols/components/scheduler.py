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

    Constructed as ``factory(config: EngineConfig, kv_cache: KVCacheManager)``. Lives
    in the engine-core process; its methods are called by the engine only, never
    concurrently. It must not block, touch the GPU, or allocate per token beyond the
    lists it returns. It owns stopping on token ids (EOS, stop_token_ids, max_tokens,
    model length); stop strings are matched by the frontend, which then aborts the
    request.
    """

    @abstractmethod
    def add_request(self, request: GenerateRequest) -> None:
        """Queue a request. Raises QueueFullError when the waiting queue is full, and
        ValueError when it can never fit (prompt longer than the model length)."""

    @abstractmethod
    def abort_requests(self, request_ids: Iterable[str]) -> list[TokenDelta]:
        """Finish these requests now (unknown ids are ignored) and free their blocks.
        Returns one delta with finish_reason "abort" per request that was live."""

    @abstractmethod
    def schedule(self) -> StepInput:
        """Build the next step. Returns a StepInput with no chunks when idle."""

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
