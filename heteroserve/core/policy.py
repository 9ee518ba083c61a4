"""Scheduling policies: the order of the waiting queue and the choice of whom to preempt."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from heteroserve.core.request import Request


class SchedulingPolicy:
    """First come, first served: a preempted request keeps its place ahead of later arrivals."""

    name = "fcfs"
    can_preempt_for_waiting = False

    def key(self, request: Request, arrival_index: int) -> tuple:
        return (arrival_index,)


class PriorityPolicy(SchedulingPolicy):
    """Lower `priority` first, FCFS within a priority; a more urgent arrival may preempt a running request."""

    name = "priority"
    can_preempt_for_waiting = True

    def key(self, request: Request, arrival_index: int) -> tuple:
        return (request.priority, arrival_index)


POLICIES = {p.name: p for p in (SchedulingPolicy, PriorityPolicy)}


class RequestQueue:
    """Waiting requests ordered by the policy's key, which a request keeps for life."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self._heap: list[tuple[tuple, Request]] = []
        self._keys: dict[str, tuple] = {}
        self._arrivals = itertools.count()

    def key_of(self, request: Request) -> tuple:
        if request.request_id not in self._keys:
            self._keys[request.request_id] = self.policy.key(request, next(self._arrivals))
        return self._keys[request.request_id]

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (self.key_of(request), request))

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        self._heap = [item for item in self._heap if item[1] is not request]
        heapq.heapify(self._heap)

    def forget(self, request: Request) -> None:
        self._keys.pop(request.request_id, None)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (item[1] for item in sorted(self._heap, key=lambda item: item[0]))
