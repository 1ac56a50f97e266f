"""Requests held back after an SLO preemption (docs/design.md sections 4 and 9).

A mid-forward preemption stops a step so that an urgent waiter can go first. For that step to
be the waiter's own, the victim and every chunk the rollback kept (suspend mode) are held back:
not scheduled, and not admitted if they wait, until the waiter's client has its first output
(or the waiter is gone). A victim is then held until it is also the most urgent again, so that
it does not take back the room it was preempted to make. A paused victim stays running with
its KV; a recomputed one waits in the queue without blocking anyone queued behind it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol

from engine.core.request import Request
from engine.core.request_queue import RequestQueue

logger = logging.getLogger(__name__)

# The slack ranking (SlackPolicy.rank): `requests` in order of urgency at `now`.
Rank = Callable[[Iterable[Request], float], list[Request]]


class HeldRequests(Protocol):
    """What releasing holds sees of the scheduler (`Scheduler` is one)."""

    @property
    def waiting(self) -> RequestQueue: ...

    @property
    def running(self) -> list[Request]: ...

    def get_request(self, req_id: str) -> Request | None: ...


class PreemptionHolds:
    """Who is held back, for which waiter, and which of them are victims."""

    def __init__(self) -> None:
        # Not scheduled: victims of SLO preemptions and the chunks kept from the steps
        # they stopped, held back until their waiter's client has its first output (and
        # victims until no request with prefill left is more urgent than they are). A paused
        # one stays running with its KV; a recomputed one waits and is not admitted (else it
        # would share the very next step with the waiter it made room for).
        self.held: set[str] = set()
        # Held request -> the waiter of the preemption that held it: whatever else, it stays
        # held until that waiter's client has its first output (or it is gone), so that the
        # waiter's steps are its own (the victim, and every chunk kept from the unwound step).
        self.yielding_to: dict[str, str] = {}
        # The held requests that are victims: once their waiter is served, they also wait
        # until they are the most urgent again.
        self.victims: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.held)

    def is_held(self, req_id: str) -> bool:
        return req_id in self.held

    def hold(self, victim_id: str, kept: Iterable[str], waiter_id: str) -> None:
        """An SLO preemption of `victim_id` for `waiter_id`: the victim and the chunks the
        rollback kept (`kept`) wait for the waiter."""
        for req_id in {victim_id, *kept} - {waiter_id}:
            self.held.add(req_id)
            self.yielding_to[req_id] = waiter_id
        self.victims.add(victim_id)

    @contextmanager
    def waiting_past_held(self, waiting: RequestQueue) -> Iterator[Callable[[], Request | None]]:
        """Yields a function that peeks at the first waiting request that is not held back.

        A held victim waits for its turn without blocking anyone queued behind it: held
        requests met at the head are lifted off the queue, and put back in their order (and
        so at their places, ahead of everyone left) on exit.
        """
        lifted: list[Request] = []

        def next_waiter() -> Request | None:
            while waiting:
                request = waiting.peek()
                if request.request_id not in self.held:
                    return request
                lifted.append(waiting.pop())
            return None

        try:
            yield next_waiter
        finally:
            for request in reversed(lifted):
                waiting.prepend(request)

    def release_due(self, requests: HeldRequests, rank: Rank) -> None:
        """A held request runs again once the client of the waiter it yielded to has its first
        output (a first token with no text is not enough; docs/design.md section 9) (or it is
        gone); a held victim only once, also, no request with prefill left (waiting or
        running, and not held itself) is more urgent than it by `rank`."""
        now = time.monotonic()
        contenders = [r for r in (*requests.waiting, *requests.running)
                      if r.request_id not in self.held and r.awaiting_first_output]

        def ranks_first(request: Request) -> bool:
            # Listed first, so that a tie releases it.
            return rank([request, *contenders], now)[0] is request

        for req_id in list(self.held):
            request = requests.get_request(req_id)
            assert request is not None, f"held request {req_id} is gone"
            waiter_id = self.yielding_to.get(req_id)
            if waiter_id is not None:
                waiter = requests.get_request(waiter_id)
                if waiter is not None and waiter.awaiting_first_output:
                    continue
                del self.yielding_to[req_id]
            if req_id not in self.victims or ranks_first(request):
                logger.debug("release held %s (victim %s)", req_id, req_id in self.victims)
                self.release(req_id)

    def release(self, req_id: str) -> None:
        """It is no longer held (released, or finished)."""
        self.held.discard(req_id)
        self.victims.discard(req_id)
        self.yielding_to.pop(req_id, None)

    def release_all(self) -> None:
        """Holding a victim back is for letting someone else run first; when nobody else can
        run, it only stalls the engine (an empty step that would repeat forever)."""
        self.held.clear()
        self.yielding_to.clear()
        self.victims.clear()

    def check_invariants(self, live_ids: set[str]) -> None:
        assert self.held <= live_ids, "a finished request is still held back"
        assert set(self.yielding_to) | self.victims <= self.held, "a hold without its request"
