"""The speculative-decoding proposer interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenloom.protocols.components.model import ModelInfo
    from tokenloom.protocols.step import NewRequestData


class Proposer(ABC):
    """Drafts the tokens a request's next step verifies. Constructed as
    ``factory(config: EngineConfig)``.

    Lives in the executor (engine-core process, rank 0). Per step the executor
    verifies the drafts it was given, reads the accepted tokens on the host, then
    calls ``propose`` once for the requests that speculate; the drafts travel back
    to the scheduler in ``StepOutput.draft_token_ids`` and come back as the trailing
    ``num_draft_tokens`` of the request's next chunk. A proposer may keep state per
    request (a draft model's KV); it must propose deterministically given that
    state, so that a draft ``d`` counts as drawn from the one-hot distribution at
    ``d`` (the executor's rejection sampler then accepts it with probability p(d)).
    """

    name: str
    # The PluginManager that built this proposer (``PluginManager.build`` sets it): where
    # a draft model's weight method comes from. None: built directly.
    plugins: Any = None

    def bind(self, target: ModelInfo) -> None:  # noqa: B027
        """Called once by the executor after the target model loaded: a proposer
        that needs the target's shape checks it here (a draft model's vocabulary
        must equal the target's) and raises ValueError when it cannot serve it."""

    def add_request(self, data: NewRequestData) -> None:  # noqa: B027
        """A request that may speculate arrived (called once, before ``propose``)."""

    def remove_requests(self, request_ids: Iterable[str]) -> None:  # noqa: B027
        """Requests finished: drop their state (unknown ids are ignored)."""

    @abstractmethod
    def propose(
        self,
        request_ids: Sequence[str],
        token_histories: Sequence[Sequence[int]],
        num_tokens: Sequence[int],
    ) -> list[list[int]]:
        """Up to ``num_tokens[i]`` draft tokens (possibly none) to follow each
        request's full history (prompt + accepted output). The lists are the
        executor's live histories: a proposer may keep a reference (it grows as
        tokens are accepted) but must never mutate one."""
