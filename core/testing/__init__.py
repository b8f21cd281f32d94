"""``tokenloom.testing``: conformance suites a third-party component runs against itself.

Each suite is a pytest class; subclass it in a test module and name your factory:

    from tokenloom.testing import SchedulerConformance

    class TestMyScheduler(SchedulerConformance):
        factory = MyScheduler

Suites: ``SchedulerConformance``, ``KVCacheConformance``, ``AttentionConformance``
and ``ProposerConformance``. The built-in components run the same suites
(``tests/core/testing/``). Needs pytest and hypothesis (test dependencies).
"""

from tokenloom.testing.attention import AttentionConformance
from tokenloom.testing.harness import FakeClock, Harness, run_operations
from tokenloom.testing.kv_cache import KVCacheConformance
from tokenloom.testing.proposer import ProposerConformance
from tokenloom.testing.scheduler import SchedulerConformance

__all__ = [
    "AttentionConformance",
    "FakeClock",
    "Harness",
    "KVCacheConformance",
    "ProposerConformance",
    "SchedulerConformance",
    "run_operations",
]
