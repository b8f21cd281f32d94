"""Shortest-prompt-first with aging: a scheduler policy in one short file.

The waiting request with the smallest ``prompt_tokens / RATE - seconds_waited``
starts first: short prompts overtake long ones (their prefill is short, so many
first tokens come out for the price of one long prefill), and each second of
waiting is worth ``RATE`` prompt tokens, so no long prompt starves. Aging that is
linear in time never changes the order of two waiting requests (both keys fall by
the same amount), so the key is the constant ``arrival + prompt_tokens / RATE``:
no re-keying is needed. Everything else (chunked prefill, preemption, stopping)
is ``continuous``'s.

Compare it with the default in the simulator (docs/sim.md has the result):

    tokenloom sim --trace azure-code --speed 2 --plugin examples/schedulers/spf_aging.py \\
        --scheduler continuous,spf-aging

and on a real server, as a third-party package would add it: an entry point in
the group ``tokenloom`` (``spf-aging = spf_aging``), with this folder importable
(``scripts/gpu/sim.sh`` writes one), then ``tokenloom serve ... --scheduler spf-aging``.
"""

from __future__ import annotations

from typing import Any

from tokenloom.plugins.scheduler.batch_scheduler import BatchScheduler
from tokenloom.plugins.scheduler.request_state import RequestState
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl

RATE = 1024.0  # prompt tokens one second of waiting is worth


class ShortestPromptFirstAging(BatchScheduler):
    def priority(self, state: RequestState, now: float) -> Any:
        arrival = state.arrival_time or now
        # Explicit priorities still come first; within one, the aged prompt length.
        return (state.priority, arrival + state.num_prompt_tokens / RATE)


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            "scheduler", "spf-aging", ShortestPromptFirstAging, "shortest prompt first, with aging"
        )
    ]
