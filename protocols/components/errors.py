"""The errors that cross component interfaces: raised on one side, caught on the other.

The frontends catch these without importing the engine-core's code: the engine
client (``tokenloom.engine.client``) raises ``EngineError`` and ``EngineDeadError``;
a scheduler (and the frontends' own admission count) raises ``QueueFullError``.
"""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later."""


class EngineError(RuntimeError):
    """The engine refused or failed a request; ``code`` is HTTP-like (400, 413, 503, 500)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class EngineDeadError(RuntimeError):
    """The engine-core process is gone."""
