"""The waiting queue: O(log n) per operation, never a scan.

Two heaps on the policy's key, (arrival) for `fcfs` and (priority, arrival) for
`priority`: one for short prompts (at most `short_tokens` to compute when queued) and
one for the rest. The head is the older of the two heads, except that a short head goes
first when it arrived less than `overtake_s` after the long one (and has no worse a
priority). So a 100-token question does not wait out the prefill of a 16K-token
document queued a moment before it (each long prefill step is ~0.2 s on an H200), the
long document loses at most the few ms the short prompt's tokens take from a step, and
no long request is passed over for longer than `overtake_s`: once it has waited that
much longer than the oldest short one, it is the head, and the head blocks the queue.

A preempted request keeps its key, so it goes back ahead of everything that arrived
after it. Removal (abort, queue timeout) is lazy: the request's `queue_gen` moves on,
and entries whose generation no longer matches are dropped when they reach the head.
"""

from __future__ import annotations

import heapq

from pagefleet.server.engine.request import Request, Status

Entry = tuple[tuple, int, Request]


class WaitQueue:
    def __init__(self, policy: str, short_tokens: int = 0, overtake_s: float = 0.0) -> None:
        self.policy = policy
        self.short_tokens = short_tokens
        self.overtake_s = overtake_s
        self._short: list[Entry] = []
        self._long: list[Entry] = []
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
        short = req.num_tokens - req.num_computed_tokens <= self.short_tokens
        heapq.heappush(self._short if short else self._long,
                       (req.sort_key(self.policy), req.queue_gen, req))
        self._len += 1

    def remove(self, req: Request) -> None:
        """Forget a waiting request (its stale entry is skipped later)."""
        req.queue_gen += 1
        self._len -= 1

    def _top(self, heap: list[Entry]) -> Entry | None:
        while heap and not self._live(heap[0][1], heap[0][2]):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def _head_heap(self) -> list[Entry] | None:
        s, lg = self._top(self._short), self._top(self._long)
        if s is None or lg is None:
            return self._short if s is not None else (self._long if lg is not None else None)
        if s[0] < lg[0]:
            return self._short
        short_req, long_req = s[2], lg[2]
        same_rank = self.policy != "priority" or short_req.priority <= long_req.priority
        if same_rank and short_req.arrival_time - long_req.arrival_time < self.overtake_s:
            return self._short
        return self._long

    def peek(self) -> Request | None:
        heap = self._head_heap()
        return heap[0][2] if heap else None

    def pop(self) -> Request:
        heap = self._head_heap()
        assert heap, "pop from an empty queue"
        req = heapq.heappop(heap)[2]
        req.queue_gen += 1
        self._len -= 1
        return req

    def __iter__(self):
        """Live requests in no particular order (for tests and introspection)."""
        return (r for _, g, r in self._short + self._long if self._live(g, r))
