"""Parallel samples of one prompt (``n > 1``, a prompt sent several times) share its KV through
the prefix cache instead of prefilling it n times.

Siblings that arrive together would all be admitted in the same step, before any of them has
a cached block for the others to hit. So each sibling names a leader (``Request.prefill_after``)
and is parked here, outside the queues, until the leader's prompt is computed (its first token
exists: every full block of the prompt is committed to the cache) or the leader ends; then it
joins the waiting queue and its admission finds the prompt's blocks in the cache. Only the
prompt's last partial block is computed again per sibling.
"""

from __future__ import annotations

from engine.core.request import Request


class SiblingGate:
    def __init__(self) -> None:
        # leader id -> the siblings waiting on its prefill, in arrival order.
        self._parked: dict[str, list[Request]] = {}
        self._leader_of: dict[str, str] = {}

    def park(self, request: Request, leader: Request | None) -> bool:
        """Hold ``request`` until ``leader`` (its prefill_after, None if unknown or gone) has its
        first token. False when there is nothing to wait for: it is queued at once."""
        if leader is None or leader.num_output_tokens > 0 or leader.is_finished:
            return False
        self._parked.setdefault(leader.request_id, []).append(request)
        self._leader_of[request.request_id] = leader.request_id
        return True

    def release(self, leader_id: str) -> list[Request]:
        """The siblings to queue now that ``leader_id`` has its first token or has ended."""
        released = self._parked.pop(leader_id, [])
        for request in released:
            del self._leader_of[request.request_id]
        return released

    def remove(self, req_id: str) -> Request | None:
        """Take a parked request out (it is aborted); None if it is not parked."""
        leader_id = self._leader_of.pop(req_id, None)
        if leader_id is None:
            return None
        siblings = self._parked[leader_id]
        request = next(r for r in siblings if r.request_id == req_id)
        siblings.remove(request)
        if not siblings:
            del self._parked[leader_id]
        return request

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._leader_of

    @property
    def parked_ids(self) -> set[str]:
        return set(self._leader_of)
