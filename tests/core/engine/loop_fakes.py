"""A fake ``EngineCore`` (``protocols.components.engine``), for loop and supervisor tests.

Each step gives every running request one token (token = its step count); a
request finishes after ``params.max_tokens`` tokens. Module-level so that a spawned
engine-core process can import the factory by reference.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from tokenloom.protocols.components.errors import QueueFullError
from tokenloom.protocols.control import Ready
from tokenloom.protocols.outputs import EngineStats, FinishReason, TokenDelta
from tokenloom.protocols.requests import GenerateRequest

MAX_WAITING = 4


class FakeEngine:
    def __init__(self, step_s: float = 0.001, max_running: int = MAX_WAITING) -> None:
        self.step_s = step_s
        self.max_running = max_running
        self.running: dict[str, list[int]] = {}  # request id -> output tokens
        self.limits: dict[str, int] = {}
        self.num_steps = 0
        self.shut_down = False

    def add_request(self, req: GenerateRequest) -> None:
        if not req.prompt_token_ids:
            raise ValueError("prompt_token_ids: must not be empty")
        if len(self.running) >= self.max_running:
            raise QueueFullError(f"{len(self.running)} requests waiting")
        self.running[req.request_id] = []
        self.limits[req.request_id] = req.params.max_tokens or 16

    def abort(self, request_ids: Sequence[str]) -> list[TokenDelta]:
        deltas = []
        for rid in request_ids:
            if self.running.pop(rid, None) is not None:
                deltas.append(TokenDelta(rid, [], FinishReason.ABORT))
        return deltas

    def step(self) -> list[TokenDelta]:
        time.sleep(self.step_s)
        self.num_steps += 1
        deltas = []
        for rid, tokens in list(self.running.items()):
            tokens.append(len(tokens))
            done = len(tokens) >= self.limits[rid]
            deltas.append(TokenDelta(rid, [tokens[-1]], FinishReason.LENGTH if done else None))
            if done:
                del self.running[rid]
        return deltas

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.running), num_steps=self.num_steps)

    def ready_info(self) -> Ready:
        return Ready(pid=os.getpid(), model_name="fake", max_num_seqs=self.max_running)

    def shutdown(self) -> None:
        self.shut_down = True


def make_fake_engine(config: Any, plugin_manager: Any) -> FakeEngine:
    """Engine factory for the supervisor: ``model = "fail"`` fails start-up,
    ``model = "slow"`` makes each step take 50 ms."""
    if config.model == "fail":
        raise RuntimeError("fake engine refused to start: boom")
    return FakeEngine(step_s=0.05 if config.model == "slow" else 0.001)
