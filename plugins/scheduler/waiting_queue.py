"""The waiting queue: requests ordered by (priority, arrival), O(log n) per operation.

A binary heap with lazy removal: ``discard`` only marks the request's entry dead,
and dead entries are dropped when they reach the top (or in a rebuild once they
outnumber the live ones). Nothing here sorts the whole queue per step.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from tokenloom.plugins.scheduler.request_state import RequestState

_Entry = tuple[tuple[int, int], int, RequestState]  # (sort key, entry id, request)


class WaitingQueue:
    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._num_live = 0
        self._next_entry = 1

    def __len__(self) -> int:
        return self._num_live

    def push(self, state: RequestState) -> None:
        """Queue ``state`` (which must not be queued already)."""
        entry = self._next_entry
        self._next_entry += 1
        state.queue_entry = entry
        heapq.heappush(self._heap, (state.sort_key, entry, state))
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
            self._heap = [item for item in self._heap if item[2].queue_entry == item[1]]
            heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[RequestState]:
        """Live requests, in no particular order."""
        return (item[2] for item in self._heap if item[2].queue_entry == item[1])
