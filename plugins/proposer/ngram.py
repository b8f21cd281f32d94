"""Proposer plugin ``ngram``: prompt lookup.

For each request, match the last ``n`` tokens of its history (``n`` from
``max_n`` down to ``min_n``) against earlier positions of the same history (prompt
and output), and propose the tokens that followed the most recent match. Pays off
when the output repeats the input (editing code, quoting, extraction). Pure host
work; deterministic, so each draft is a one-hot proposal.

Options (``[plugin.ngram]`` or ``--plugin-option ngram.KEY=VALUE``): ``min_n``
(default 1), ``max_n`` (default 4), ``window`` (default 4096: only the last this
many tokens are searched, which bounds the host cost per step).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import msgspec

from tokenloom.config import EngineConfig, plugin_settings
from tokenloom.protocols.components.proposer import Proposer
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl


def ngram_lookup(
    history: Sequence[int], k: int, min_n: int = 1, max_n: int = 4, window: int = 4096
) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the
    longest suffix (``max_n`` .. ``min_n`` tokens) of ``history``; [] when none."""
    size = min(len(history), window)
    if k <= 0 or size < min_n + 1:
        return []
    tokens = history[len(history) - size :]
    # Searched as bytes (4 per token): rfind runs in C, which matters at 4096 tokens
    # times every speculating request per step. A hit must start on a token boundary.
    data = array("i", tokens).tobytes()
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        needle = data[(size - n) * 4 :]
        limit = (size - 1) * 4  # a match must end before the last token
        pos = data.rfind(needle, 0, limit)
        while pos > 0 and pos % 4:
            pos = data.rfind(needle, 0, pos + len(needle) - 1)
        if pos >= 0:
            index = pos // 4 + n
            return list(tokens[index : index + k])
    return []


class NgramSettings(msgspec.Struct, forbid_unknown_fields=True):
    """``[plugin.ngram]``: the match lengths tried and the search window (tokens)."""

    min_n: int = 1
    max_n: int = 4
    window: int = 4096


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, config: EngineConfig) -> None:
        options = plugin_settings(config, "ngram", NgramSettings)
        self.min_n = options.min_n
        self.max_n = options.max_n
        self.window = options.window
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(
                f"plugin.ngram: need 1 <= min_n <= max_n, got min_n={self.min_n}, "
                f"max_n={self.max_n}"
            )

    def propose(
        self,
        request_ids: Sequence[str],
        token_histories: Sequence[Sequence[int]],
        num_tokens: Sequence[int],
    ) -> list[list[int]]:
        return [
            ngram_lookup(history, k, self.min_n, self.max_n, self.window)
            for history, k in zip(token_histories, num_tokens, strict=True)
        ]


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            "proposer",
            "ngram",
            NgramProposer,
            "prompt-lookup n-gram drafts",
            settings=NgramSettings,
        )
    ]
