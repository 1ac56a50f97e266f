"""Waiting-queue policies. The scheduler only ever talks to the ``RequestQueue`` interface."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator

from engine.core.request import Request


class RequestQueue(ABC):
    """Order in which waiting requests are admitted. ``peek``/``pop`` give the next one."""

    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Re-queue a preempted request ahead of anything that would otherwise tie with it."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """In admission order."""

    def __bool__(self) -> bool:
        return len(self) > 0

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self)


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty queue")
        return self._queue[0]

    def pop(self) -> Request:
        if not self._queue:
            raise IndexError("pop from an empty queue")
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue(RequestQueue):
    """Lower ``priority`` first, then earlier ``arrival_time``, then insertion order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        # Insertion order breaks ties; prepends count down so they sort before every add.
        self._add_seq = itertools.count()
        self._prepend_seq = itertools.count(-1, -1)

    def _push(self, request: Request, seq: int) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, seq, request))

    def add(self, request: Request) -> None:
        self._push(request, next(self._add_seq))

    def prepend(self, request: Request) -> None:
        self._push(request, next(self._prepend_seq))

    def peek(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][3]

    def pop(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        # O(n), but only aborts remove from the middle, and those are rare.
        for i, entry in enumerate(self._heap):
            if entry[3] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id} is not in the queue")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


class UrgencyQueue(RequestQueue):
    """Slack-EDF (`slo` policy): the slo policy's order, ties by arrival.

    The order is not a sort by one number: a doomed request goes ahead of every request whose
    slack covers its predicted prefill (monitor.policy.rank). `order` gives it (the requests,
    in arrival order, in the policy's order); the slack policy hands it to `refresh()` every
    step and it is kept for later re-sorts. Without one, the queue sorts by the scalar
    `urgency` (highest first). Urgency changes with time, so no heap can hold it: the queue is
    re-sorted by `refresh()`, which the scheduler calls once per step, and after additions on
    the next peek.
    """

    def __init__(self, urgency: Callable[[Request], float],
                 order: Callable[[list[Request]], list[Request]] | None = None) -> None:
        self._urgency = urgency
        self._order = order
        self._items: list[Request] = []
        self._sorted = True

    def refresh(self, order: Callable[[list[Request]], list[Request]] | None = None) -> None:
        """Re-sort now; `order`, if given, replaces the ordering from now on."""
        if order is not None:
            self._order = order
        by_arrival = sorted(self._items, key=lambda r: r.arrival_time)
        if self._order is not None:
            self._items = list(self._order(by_arrival))
        else:
            self._items = sorted(by_arrival, key=lambda r: -self._urgency(r))
        self._sorted = True

    def add(self, request: Request) -> None:
        self._items.append(request)
        self._sorted = False

    def prepend(self, request: Request) -> None:
        self._items.insert(0, request)
        self._sorted = False

    def peek(self) -> Request:
        if not self._items:
            raise IndexError("peek from an empty queue")
        if not self._sorted:
            self.refresh()
        return self._items[0]

    def pop(self) -> Request:
        request = self.peek()
        self._items.pop(0)
        return request

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        if not self._sorted:
            self.refresh()
        return iter(list(self._items))


def create_request_queue(policy: str,
                         urgency: Callable[[Request], float] | None = None,
                         order: Callable[[list[Request]], list[Request]] | None = None
                         ) -> RequestQueue:
    """`urgency` and `order`: the slo policy's (see UrgencyQueue)."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    if policy == "slo":
        if urgency is None:
            raise ValueError("the slo policy needs an urgency function")
        return UrgencyQueue(urgency, order)
    raise ValueError(f"unknown scheduling policy {policy!r} (expected fcfs, priority or slo)")
