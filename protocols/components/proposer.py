"""The speculative-decoding proposer interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class Proposer(ABC):
    """Speculative-decoding proposer. Constructed as ``factory(config: EngineConfig)``.

    Called by the executor each decode step, before the target forward pass.
    """

    name: str

    @abstractmethod
    def propose(self, token_histories: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        """Up to ``k`` draft tokens per request (possibly none) given each request's
        full token history (prompt + output)."""
