"""Proposer plugin ``replay`` (contrib, for measuring only): drafts at a chosen
acceptance rate.

It proposes the tokens an earlier run of the same request produced (keyed by the
prompt's token ids), each replaced with probability ``1 - acceptance`` by a random
different token. On a greedy request of a deterministic model (random weights
included) a recorded token is always right and a replaced one always wrong, so
each draft is accepted with probability ``acceptance`` until the first miss: a
benchmark measures speculative decoding's speed at that rate without a real
draft model. It knows nothing about language; never serve with it.

Recordings come from this process (every finished request that speculated, k > 0,
has its output kept, the longest per prompt) or from a JSONL file of ``{"prompt": [...], "output": [...]}``
lines. A request without a recording (or whose output left the recording) gets no
drafts. Options (``[plugin.replay]``): ``acceptance`` (default 1.0), ``seed``
(default 0), ``path`` (default "": no file).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec

from tokenloom.config import EngineConfig, plugin_settings
from tokenloom.protocols.components.proposer import Proposer
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl
from tokenloom.protocols.step import NewRequestData

if TYPE_CHECKING:
    from tokenloom.protocols.components.model import ModelInfo


class ReplaySettings(msgspec.Struct, forbid_unknown_fields=True):
    """``[plugin.replay]``: the acceptance rate, its random seed, and a JSONL file of
    recordings ("" for none)."""

    acceptance: float = 1.0
    seed: int = 0
    path: str = ""


class ReplayProposer(Proposer):
    name = "replay"

    def __init__(self, config: EngineConfig) -> None:
        options = plugin_settings(config, "replay", ReplaySettings)
        self.acceptance = options.acceptance
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"plugin.replay.acceptance: must be in [0, 1], got {self.acceptance}")
        self._rng = random.Random(options.seed)
        self.vocab_size = 2
        self.recordings: dict[tuple[int, ...], list[int]] = {}
        self._prompts: dict[str, tuple[int, ...]] = {}
        self._last: dict[str, Sequence[int]] = {}  # each live request's latest history
        path = options.path
        if path:
            with open(path) as lines:
                for line in lines:
                    if line.strip():
                        entry = json.loads(line)
                        self.record(entry["prompt"], entry["output"])

    def bind(self, target: ModelInfo) -> None:
        self.vocab_size = target.vocab_size

    def record(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Keep ``output`` as the recording of ``prompt`` unless a longer one exists."""
        key = tuple(prompt)
        if len(output) > len(self.recordings.get(key, ())):
            self.recordings[key] = list(output)

    def add_request(self, data: NewRequestData) -> None:
        self._prompts[data.request_id] = tuple(data.prompt_token_ids)

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            prompt = self._prompts.pop(request_id, None)
            history = self._last.pop(request_id, None)
            if prompt is not None and history is not None:
                self.record(prompt, history[len(prompt) :])

    def propose(
        self,
        request_ids: Sequence[str],
        token_histories: Sequence[Sequence[int]],
        num_tokens: Sequence[int],
    ) -> list[list[int]]:
        drafts = []
        for request_id, history, k in zip(request_ids, token_histories, num_tokens, strict=True):
            self._last[request_id] = history
            drafts.append(self._replay(request_id, history, k))
        return drafts

    def _replay(self, request_id: str, history: Sequence[int], k: int) -> list[int]:
        prompt = self._prompts.get(request_id)
        if prompt is None:
            return []
        recording = self.recordings.get(prompt)
        done = len(history) - len(prompt)
        if recording is None or done < 1 or done > len(recording):
            return []
        if recording[done - 1] != history[-1]:  # this run left the recording
            return []
        drafts = recording[done : done + k]
        rng = self._rng
        for index, token in enumerate(drafts):
            if rng.random() >= self.acceptance:
                wrong = rng.randrange(self.vocab_size - 1)
                drafts[index] = wrong if wrong < token else wrong + 1
        return drafts


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            "proposer",
            "replay",
            ReplayProposer,
            "recorded drafts at a set acceptance (measuring)",
            settings=ReplaySettings,
        )
    ]
