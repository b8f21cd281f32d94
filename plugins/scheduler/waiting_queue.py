"""The waiting queue: requests ordered by a priority key that may change, O(log n) each.

A binary heap of ``(key, entry id, request)`` with lazy removal: ``discard`` only
marks the request's entry dead, and dead entries are dropped when they reach the top
(or in a rebuild once they outnumber the live ones). The key comes from a function
given at construction (lower runs sooner); a policy whose keys change with time
(aging) calls ``update`` for one request or ``reprioritize`` for all of them, which
recomputes every key once and rebuilds the heap in O(n). Nothing here sorts the
whole queue per step.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from operator import attrgetter
from typing import Any

from tokenloom.plugins.scheduler.request_state import RequestState

_Entry = tuple[Any, int, RequestState]  # (priority key, entry id, request)

by_sort_key: Callable[[RequestState], Any] = attrgetter("sort_key")


class WaitingQueue:
    """``key(state)`` gives a request's priority key (lower runs sooner; ties go to
    the earlier push). The default is ``state.sort_key``: (priority, arrival)."""

    def __init__(self, key: Callable[[RequestState], Any] = by_sort_key) -> None:
        self.key = key
        self._heap: list[_Entry] = []
        self._num_live = 0
        self._next_entry = 1

    def __len__(self) -> int:
        return self._num_live

    def push(self, state: RequestState) -> None:
        """Queue ``state`` (which must not be queued already) under its current key."""
        entry = self._next_entry
        self._next_entry += 1
        state.queue_entry = entry
        heapq.heappush(self._heap, (self.key(state), entry, state))
        self._num_live += 1

    def peek(self) -> RequestState | None:
        """The request that runs next, or None when empty."""
        heap = self._heap
        while heap:
            _, entry, state = heap[0]
            if state.queue_entry == entry:
                return state
            heapq.heappop(heap)
        return None

    def pop(self) -> RequestState | None:
        state = self.peek()
        if state is not None:
            heapq.heappop(self._heap)
            state.queue_entry = 0
            self._num_live -= 1
        return state

    def discard(self, state: RequestState) -> None:
        """Remove ``state`` if queued (O(1); its entry is dropped later)."""
        if not state.queue_entry:
            return
        state.queue_entry = 0
        self._num_live -= 1
        if len(self._heap) > 2 * self._num_live + 64:
            self._compact()

    def update(self, state: RequestState) -> None:
        """Recompute the key of one queued request (O(log n)); no-op when not queued."""
        if state.queue_entry:
            self.discard(state)
            self.push(state)

    def reprioritize(self) -> None:
        """Recompute every live request's key and rebuild the heap (O(n)). Ties keep
        their push order."""
        key = self.key
        live = [item for item in self._heap if item[2].queue_entry == item[1]]
        self._heap = [(key(state), entry, state) for _, entry, state in live]
        heapq.heapify(self._heap)

    def _compact(self) -> None:
        self._heap = [item for item in self._heap if item[2].queue_entry == item[1]]
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[RequestState]:
        """Live requests, in no particular order."""
        return (item[2] for item in self._heap if item[2].queue_entry == item[1])
