"""Proposer plugin ``none``: no speculative decoding."""

from __future__ import annotations

from collections.abc import Sequence

from tokenloom.config import EngineConfig
from tokenloom.protocols.components.proposer import Proposer
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl


class NoProposer(Proposer):
    name = "none"

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def propose(
        self,
        request_ids: Sequence[str],
        token_histories: Sequence[Sequence[int]],
        num_tokens: Sequence[int],
    ) -> list[list[int]]:
        return [[] for _ in request_ids]


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [ComponentSpec("proposer", "none", NoProposer, "no speculative decoding")]
