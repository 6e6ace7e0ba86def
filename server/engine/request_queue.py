"""The waiting queue: O(log n) per operation, never a scan.

A heap on the policy's key: (arrival) for `fcfs`, (priority, arrival) for `priority`.
A preempted request keeps its key, so it goes back ahead of everything that arrived
after it. Removal (abort, queue timeout) is lazy: the request's `queue_gen` moves on,
and entries whose generation no longer matches are dropped when they reach the head.
"""

from __future__ import annotations

import heapq

from pagefleet.server.engine.request import Request, Status


class WaitQueue:
    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._heap: list[tuple[tuple, int, Request]] = []
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    @staticmethod
    def _live(gen: int, req: Request) -> bool:
        return req.queue_gen == gen and req.status is Status.WAITING

    def add(self, req: Request) -> None:
        req.queue_gen += 1
        req.status = Status.WAITING
        heapq.heappush(self._heap, (req.sort_key(self.policy), req.queue_gen, req))
        self._len += 1

    def remove(self, req: Request) -> None:
        """Forget a waiting request (its stale entry is skipped later)."""
        req.queue_gen += 1
        self._len -= 1

    def peek(self) -> Request | None:
        heap = self._heap
        while heap and not self._live(heap[0][1], heap[0][2]):
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def pop(self) -> Request:
        req = self.peek()
        assert req is not None, "pop from an empty queue"
        heapq.heappop(self._heap)
        req.queue_gen += 1
        self._len -= 1
        return req

    def __iter__(self):
        """Live requests in no particular order (for tests and introspection)."""
        return (r for _, g, r in self._heap if self._live(g, r))
