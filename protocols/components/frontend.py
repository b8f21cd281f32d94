"""The frontend interface: an external protocol (HTTP, ZeroMQ jobs) in front of the engine."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Frontend(ABC):
    """Translates an external protocol to the engine protocol.

    Constructed as ``factory(config: EngineConfig, engine: EngineClient, tokenizer:
    Tokenizer, ready: Ready | None)`` in the frontend process; ``ready`` is the
    engine-core's handshake (model length, vocabulary, EOS ids).
    """

    name: str

    @abstractmethod
    async def serve(self) -> None:
        """Serve until cancelled; cancellation must stop accepting work and return."""
