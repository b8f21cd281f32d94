"""The built-in schedulers pass ``tokenloom.testing.SchedulerConformance``: random add /
abort / step sequences through each scheduler and the paged KV manager, synchronous
and pipelined, roomy and under KV pressure (see ``tokenloom.testing.harness``)."""

from __future__ import annotations

from tokenloom.contrib.schedulers.static import StaticScheduler
from tokenloom.plugins.scheduler.continuous import ContinuousScheduler
from tokenloom.testing import SchedulerConformance


class TestContinuousConformance(SchedulerConformance):
    factory = ContinuousScheduler


class TestStaticConformance(SchedulerConformance):
    factory = StaticScheduler
