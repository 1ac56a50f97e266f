"""Fleet admission: whether any replica can still serve a request within its TTFT objective.

A request is doomed when, on every fresh replica, it misses its objective even at the
optimistic bound (`Prediction.optimistic_ttft_s`): the running step ends, or is stopped for it
after the preemption latency where it can be; then only the requests that replica's monitor
serves before it (more urgent ones) come first, packed into its own steps (their tokens'
marginal work, none of their step overheads); all at the step model's optimistic speed. That
is the replica monitor's own test for doomed taken at the fleet's best case, with the work no
reordering could move out of its way: the more urgent requests would be served first on any
replica it went to. Without that queue the bound refused nothing even where `serve` missed 49
urgent turns (fleet-bursts at 80 req/s on 4 replicas); with it, the documents it refused on 2
replicas each missed when served (bench/results/HISTORY.md). A request without an objective is
never doomed, nor is any request while no replica is fresh (the router knows nothing then, and
refusing on ignorance would turn a reporting hiccup into an outage).

What the ingress does with a doomed request is `--on-doomed` (engine.serving.doomed.OnDoomed,
which one server applies alike to itself): "serve" it anyway (it is late, its client may still
want the answer), or "reject" it with 429, the body carrying the best predicted TTFT and the
`Retry-After` header `retry_after_s`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.load.load_report import RouteHint
from engine.load.prediction import Prediction
from engine.fleet.routing import FleetBook

# Retry-After is whole seconds (RFC 9110), at least this many: a 0 invites an immediate retry
# into the same overload.
MIN_RETRY_AFTER_S = 1


@dataclass(frozen=True)
class Admission:
    doomed: bool
    # The best predicted TTFT over the fresh replicas (point estimate, from arrival) and the
    # replica that gives it; None without a fresh replica.
    predicted_ttft_s: float | None
    best_replica: str | None
    # The least optimistic TTFT over the fresh replicas (the bound doomed is judged on).
    optimistic_ttft_s: float | None
    # Seconds a rejected client should wait: until the least-loaded fresh replica has
    # prefilled everything it holds now, rounded up (see retry_after).
    retry_after_s: int


def retry_after(predictions: Sequence[Prediction]) -> int:
    """When to retry: once the fleet's shortest queue has drained (`Prediction.drain_s`, the
    prefill of everything a replica holds now, the running step included), since a request
    arriving then finds at least one replica with nothing ahead of it. Whole seconds rounded up,
    at least MIN_RETRY_AFTER_S. Deliberately not the request's own lateness: a retry sooner
    than the drain meets the same queue, and one later waits for nothing."""
    if not predictions:
        return MIN_RETRY_AFTER_S
    return max(MIN_RETRY_AFTER_S, math.ceil(min(p.drain_s for p in predictions)))


def assess(book: FleetBook, hint: RouteHint, now: float,
           candidate_ids: Sequence[str] | None = None,
           predictions: dict[str, Prediction] | None = None) -> Admission:
    """Whether `hint` is doomed on every fresh replica among `candidate_ids` (default: every
    replica the book knows). `predictions`: the router's, when it has them for this request
    (FleetBook.predictions), so that a decision predicts once."""
    ids = list(book.replicas) if candidate_ids is None else list(candidate_ids)
    if predictions is None:
        predictions = book.predictions(ids, hint, now)
    else:
        predictions = {rid: p for rid, p in predictions.items()
                       if rid in ids and book.is_fresh(rid, now)}
    if not predictions:
        return Admission(doomed=False, predicted_ttft_s=None, best_replica=None,
                         optimistic_ttft_s=None, retry_after_s=MIN_RETRY_AFTER_S)
    best = min(predictions, key=lambda rid: predictions[rid].ttft_s)
    optimistic = min(p.optimistic_ttft_s for p in predictions.values())
    doomed = hint.ttft_slo_s is not None and optimistic > hint.ttft_slo_s
    return Admission(doomed=doomed, predicted_ttft_s=predictions[best].ttft_s,
                     best_replica=best, optimistic_ttft_s=optimistic,
                     retry_after_s=retry_after(list(predictions.values())))
