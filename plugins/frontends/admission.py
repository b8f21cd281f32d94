"""Admission: whether the engine has room for a request's sequences, decided up front.

The engine refuses a request when its waiting queue is full, but by then the frontend
has decoded, tokenized and sent it, and a request that expands into many sequences
(``n``, many prompts) is refused only after its first children queued. ``Admission``
keeps the count of sequences every frontend of one engine has in flight, and refuses
a request at once (``QueueFullError``) when its sequences would take the count past
``capacity``: the engine's running slots plus its waiting queue. Nothing is awaited,
so a refusal costs microseconds whatever the concurrency.

``Admission.for_engine(engine, capacity)`` returns the one instance of an engine
client, so the HTTP and ZeroMQ frontends share the count. A ``Reservation`` holds
sequences until it is released (idempotent), and splits into one per prompt; the engine's own refusal stays as the
backstop for what the count cannot see (preempted requests, other clients).
"""

from __future__ import annotations

import weakref
from typing import Any

from tokenloom.protocols.components.errors import QueueFullError


class Reservation:
    """Sequences held for one request; ``release`` gives them back, once."""

    __slots__ = ("admission", "num_sequences")

    def __init__(self, admission: Admission, num_sequences: int) -> None:
        self.admission = admission
        self.num_sequences = num_sequences

    def split(self, num_sequences: int) -> Reservation:
        """Move ``num_sequences`` of this reservation to a new one (one per prompt)."""
        count = min(num_sequences, self.num_sequences)
        self.num_sequences -= count
        return Reservation(self.admission, count)

    def release(self, num_sequences: int | None = None) -> None:
        """Give back ``num_sequences`` (all that remain with None)."""
        count = self.num_sequences
        if num_sequences is not None:
            count = min(num_sequences, count)
        self.num_sequences -= count
        self.admission.in_flight -= count


class Admission:
    _shared: weakref.WeakKeyDictionary[Any, Admission] = weakref.WeakKeyDictionary()

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = 0  # sequences reserved and not yet released

    @classmethod
    def for_engine(cls, engine: Any, capacity: int) -> Admission:
        """The admission shared by every frontend of ``engine`` (created on first use;
        a later caller's ``capacity`` is ignored)."""
        admission = cls._shared.get(engine)
        if admission is None:
            admission = cls._shared[engine] = cls(capacity)
        return admission

    def can_admit(self, num_sequences: int) -> bool:
        return self.in_flight + num_sequences <= self.capacity

    def reserve(self, num_sequences: int) -> Reservation:
        """Hold ``num_sequences``; raises ``QueueFullError`` if they do not fit."""
        if not self.can_admit(num_sequences):
            raise QueueFullError(
                f"{self.in_flight} sequences in flight, {num_sequences} more do not fit "
                f"in {self.capacity}"
            )
        self.in_flight += num_sequences
        return Reservation(self, num_sequences)
