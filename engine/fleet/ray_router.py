"""The fleet's router as a Ray Serve `RequestRouter`: Ray Serve's plumbing, our decision.

Ray Serve hands the router each replica's latest `record_routing_stats` result (the replica's
ReplicaLoad, every report period) and the request's arguments (the ingress passes a RouteHint as
`hint`); the decision itself is engine.fleet.routing's, on a FleetBook that also counts what
this router sent since each report. One router lives in each process that holds a handle to
the engine deployment (the ingress replicas); the ingress's admission reads the same book
(engine.fleet.book_registry).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray.serve.request_router import (PendingRequest, ReplicaID, RequestRouter,
                                      RunningReplica)

from engine.load.load_report import RouteHint, decode_load
from engine.fleet.routing import FleetBook, RouterPolicy

logger = logging.getLogger(__name__)


class DeadlineRouter(RequestRouter):
    """`request_router_kwargs`: policy (engine.fleet.routing.RouterPolicy), report_period_s,
    seed (for the randomised policies; None: random)."""

    def initialize_state(self, policy: RouterPolicy = "slack", report_period_s: float = 0.1,
                         seed: int | None = None, **_: Any) -> None:
        self.policy: RouterPolicy = policy
        # Stale after five periods, and never under a second: a report reaches the router
        # through Ray Serve's controller loop (0.1 s) and a long-poll broadcast, 0.1-0.3 s old
        # on an idle machine and more under load; a live replica must not look dead.
        self.book = FleetBook(report_period_s=report_period_s, seed=seed,
                              stale_after_s=max(5 * report_period_s, 1.0))
        # The report each replica's latest stats were decoded from: decode each report once.
        self._decoded: dict[str, bytes] = {}
        # Ray's request id -> (replica, our request id), for on_request_completed.
        self._routed: dict[str, tuple[str, str]] = {}
        # Imported here, not at the top: see engine.fleet.book_registry.
        from engine.fleet.book_registry import register

        register(self._deployment_id.name, self.book)

    def _refresh(self, replicas: list[RunningReplica]) -> None:
        for replica in replicas:
            report = (replica.routing_stats or {}).get("load")
            rid = replica.replica_id.unique_id
            if report is not None and self._decoded.get(rid) is not report:
                self._decoded[rid] = report
                self.book.on_report(rid, decode_load(report))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        now = time.time()
        # A request without a hint (a probe, /v1/models, a body the replica will refuse) is
        # routed as one without a deadline.
        hint = _hint_of(pending_request) or RouteHint(request_id="", prompt_tokens=0,
                                                      ttft_slo_s=None, arrived_at=now)
        try:
            self._refresh(candidate_replicas)
            self.book.on_unchosen(hint.request_id)  # ranked again: its last choice refused it
            ranks = self.book.rank(self.policy, list(by_id), hint, now)
            if ranks and ranks[0]:
                # Counted on its first choice at once: the requests ranked before Ray Serve
                # hears the replica accept it (on_request_routed) must see it there.
                self.book.on_chosen(ranks[0][0], hint, now)
        except Exception as exc:
            # A request must never hang on the router's bug: Ray Serve's own fallback order,
            # counted (sloserve:fleet_ranking_failures_total) as well as logged.
            self.book.ranking_failures[type(exc).__name__] += 1
            logger.exception("fleet router: ranking failed; routing in Ray Serve's order")
            return [list(candidate_replicas)]
        # One replica per rank: within a rank Ray Serve picks the shortest queue by probing,
        # which would override the decision.
        return [[by_id[rid]] for rank in ranks for rid in rank if rid in by_id]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        hint = _hint_of(pending_request)
        if hint is None:
            return
        rid = replica_id.unique_id
        self.book.on_sent(rid, hint, time.time())
        self._routed[pending_request.metadata.internal_request_id] = (rid, hint.request_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        routed = self._routed.pop(internal_request_id, None)
        if routed is not None:
            self.book.on_completed(*routed)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.book.on_removed(replica_id.unique_id)
        self._decoded.pop(replica_id.unique_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        running = {r.replica_id.unique_id for r in replicas}
        for rid in [rid for rid in self._decoded if rid not in running]:
            self.book.on_removed(rid)
            del self._decoded[rid]
        self._refresh(replicas)


def _hint_of(pending_request: PendingRequest | None) -> RouteHint | None:
    if pending_request is None:
        return None
    hint = pending_request.kwargs.get("hint")
    return hint if isinstance(hint, RouteHint) else None
