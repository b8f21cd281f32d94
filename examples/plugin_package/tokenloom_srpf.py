"""Shortest-remaining-prompt-first with aging: a tokenloom scheduler plugin.

Waiting requests with the fewest prompt tokens left to compute start first, so
short requests overtake long ones; every second a request waits takes
``aging_tokens_per_s`` tokens off its key, so long ones are never starved. Set in
the config as ``scheduler = "srpf"``, tuned in ``[plugin.srpf]``.
"""

from __future__ import annotations

import msgspec

from tokenloom.config import plugin_settings
from tokenloom.plugins.scheduler.batch_scheduler import BatchScheduler
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl


class SRPFSettings(msgspec.Struct, forbid_unknown_fields=True):
    aging_tokens_per_s: float = 200.0  # key credit per second of waiting
    reprioritize_s: float = 0.05  # how often every waiting request is re-keyed


class SRPFScheduler(BatchScheduler):
    """Only public extension points: ``priority`` and ``reprioritize_interval``."""

    def __init__(self, config, kv_cache, **kwargs):  # noqa: ANN001, ANN003
        super().__init__(config, kv_cache, **kwargs)
        self.settings = plugin_settings(config, "srpf", SRPFSettings)
        self.reprioritize_interval = self.settings.reprioritize_s

    def priority(self, state, now):  # noqa: ANN001, ANN201
        waited = now - state.arrival_time
        remaining = state.num_tokens - state.num_computed  # a preempted one recomputes all
        return (remaining - self.settings.aging_tokens_per_s * waited, state.arrival_seq)


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            "scheduler",
            "srpf",
            SRPFScheduler,
            "shortest remaining prompt first, with aging",
            settings=SRPFSettings,
        )
    ]
