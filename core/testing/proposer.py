"""The speculative proposer conformance suite, in one subclass.

    from tokenloom.testing import ProposerConformance

    class TestMyProposer(ProposerConformance):
        factory = MyProposer  # called as factory(config)

It checks the ``Proposer`` contract on repetitive and random histories: at most the
asked number of drafts, token ids within the vocabulary, the same drafts from two
instances given the same calls (drafts must be deterministic for the rejection
sampler to stay exact), histories left untouched, and removal of unknown or
finished requests without error. ``config`` gives the settings it is built with.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from typing import Any, ClassVar

from tokenloom.config import EngineConfig
from tokenloom.protocols.components.proposer import Proposer
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.protocols.step import NewRequestData

VOCAB = 50


def _histories() -> list[list[int]]:
    rng = random.Random(7)
    periodic = [3, 9, 4, 7] * 6  # lookups find continuations in this one
    return [periodic, [rng.randrange(VOCAB) for _ in range(30)], [5], periodic[:9] + [1, 2]]


class ProposerConformance:
    """Subclass it with ``factory`` set; see the module docstring."""

    factory: ClassVar[Callable[..., Proposer]]
    config: ClassVar[EngineConfig] = EngineConfig(num_speculative_tokens=4)

    def _proposals(self, histories: list[list[int]], asked: list[int]) -> list[list[int]]:
        proposer = type(self).factory(self.config)
        ids = [f"r{i}" for i in range(len(histories))]
        for request_id, history in zip(ids, histories, strict=True):
            proposer.add_request(NewRequestData(request_id, history, SamplingParams()))
        drafts = proposer.propose(ids, histories, asked)
        proposer.remove_requests(ids + ["never-added"])
        return drafts

    def test_proposes_at_most_the_asked_tokens_within_the_vocabulary(self) -> None:
        histories = _histories()
        asked = [4, 3, 2, 0]
        drafts = self._proposals(histories, asked)
        assert len(drafts) == len(histories)
        for draft, limit in zip(drafts, asked, strict=True):
            assert len(draft) <= limit
            assert all(isinstance(t, int) and 0 <= t < max(VOCAB, 1 + max(sum(histories, [])))
                       for t in draft)  # fmt: skip

    def test_same_calls_give_the_same_drafts(self) -> None:
        histories = _histories()
        asked = [4, 4, 4, 4]
        assert self._proposals(histories, asked) == self._proposals(histories, asked)

    def test_leaves_the_histories_untouched(self) -> None:
        histories = _histories()
        before: Any = copy.deepcopy(histories)
        self._proposals(histories, [4, 4, 4, 4])
        assert histories == before

    def test_removing_unknown_requests_is_harmless(self) -> None:
        proposer = type(self).factory(self.config)
        proposer.remove_requests(["nobody"])
        assert proposer.propose([], [], []) == []
