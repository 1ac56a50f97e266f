"""The fleet router's bookkeeping and its policies, as pure code (no Ray: engine.fleet.ray_router
wraps it in a Ray Serve RequestRouter).

`FleetBook` keeps, per replica, the latest `ReplicaLoad`, the requests sent there since that
report was made (and those chosen for it whose sends are not yet confirmed: `on_chosen`), the
requests sent and not yet completed, and whether the report is fresh. `FleetBook.rank` orders
candidate replicas for a request as Ray Serve's `choose_replicas` returns them: a list of ranks,
the first most preferred, every candidate in exactly one (Ray falls back down the list when a
replica refuses). Each rank holds one replica: the policies below give a full order, and leaving
the pick among equals to Ray would undo it.

Policies (`RouterPolicy`):
- "slack": the request's predicted TTFT on every replica (engine.load.prediction, with the
  forecast of what will overtake it there: engine.load.arrivals); the
  replica that adds the fewest deadline misses (the request's own and those queued there),
  then the longest prefix-cache hit where it is a good share of the prompt (affinity keeps a
  document's blocks in one place), then the least predicted TTFT. A request without a
  deadline cannot miss anything: power of two choices on load (`_load`). Stale replicas (no
  report for `stale_after_s`) come after every fresh one, by load: the router cannot predict
  on them.
- "pow2": power of two choices on the requests in flight (Ray Serve's default: the baseline).
- "least-queue": vLLM's data-parallel balancing, `waiting * 4 + running`, from the reports plus
  the requests sent since.
- "round-robin".
- "prefix": the most cached leading blocks, then "least-queue"'s score.

Under every policy, a replica at its queue bound (`--max-num-queued-reqs`: its report's count
and the requests sent since, or a 429 it answered after its last report) ranks after every
replica with room: it would refuse the request, which another could serve.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

from engine.load.arrivals import ARRIVAL_WINDOW_PERIODS, MIN_SPAN_PERIODS, RecentArrivals
from engine.load.load_report import ReplicaLoad, RouteHint
from engine.load.prediction import PreparedLoad, Prediction, predict, prefill_seconds

RouterPolicy = Literal["slack", "pow2", "least-queue", "round-robin", "prefix"]
ROUTER_POLICIES: tuple[str, ...] = get_args(RouterPolicy)

# How often a replica reports its load (seconds), and after how many missed reports the router
# stops trusting it: three periods ride out one late report and a GC pause without calling a
# live replica dead, and are still short against a TTFT objective's seconds.
DEFAULT_REPORT_PERIOD_S = 0.1
STALE_AFTER_PERIODS = 3

# A request sent before `made_at` minus this is taken as already in the report. Covers the
# delivery from the router to the replica's engine queue (a Ray actor call and the ingress:
# a few ms to tens of ms) and the NTP skew between nodes (ms). A request inside the allowance
# may be counted twice (in the report and as unreported): a conservative error, the replica
# then looks a request busier than it is for one report period.
SEND_SKEW_S = 0.05

# The least relative error a prediction is trusted to (the slack policy's tie-break): a replica
# whose report claims a perfect model is still not trusted to the millisecond.
MIN_RISK_MARGIN = 0.1

# Prefix blocks the router remembers per replica from the requests it served there, beside the
# report's newest hashes. A report names only the most recent MAX_REPORTED_PREFIX_HASHES
# blocks: behind one replica's flow of long documents, a conversation's history falls out of
# it within seconds while the replica still holds it. The memory is what SGLang's cache-aware
# router keeps (what it sent where); it forgets the oldest first, and never more than the
# replica's KV pool holds (its report's `num_blocks`), so it does not outlive an eviction by
# much on a replica with a steady flow.
DEFAULT_SERVED_PREFIX_BLOCKS = 1 << 16
# The share of a prompt a replica must hold cached before the slack policy prefers it for its
# cache over a less loaded one. Below it, what the cache saves is in the predicted TTFT already,
# and affinity would only pile load onto one replica: a chat template's system prompt gives
# every conversation the same first block, and a flood of documents behind that one shared
# block went to a single replica while two others idled. SGLang's cache-aware router likewise
# follows the cache only above a match rate (its `cache_threshold`).
PREFIX_AFFINITY_SHARE = 0.3
# Routed requests whose predicted TTFT the book keeps for their responses' header.
ROUTED_PREDICTIONS_KEPT = 4096


@dataclass
class ReplicaState:
    """What the router knows of one replica."""

    # The requests with an objective sent there lately: the forecast of what will arrive.
    arrivals: RecentArrivals
    prepared: PreparedLoad | None = None
    # Sent since the report was made (oldest first): the report does not count them yet.
    unreported: list[tuple[float, RouteHint]] = field(default_factory=list)
    # Sent by this router and not completed yet: request id -> its prompt's prefix hashes.
    in_flight: dict[str, list[int]] = field(default_factory=dict)
    # Prefix blocks of the requests completed there (whose prompts it has cached), oldest
    # first (an LRU: a prefix served again moves to the end).
    served_prefixes: OrderedDict[int, None] = field(default_factory=OrderedDict)
    # When a request through this process saw the replica fail (wall clock): its reports made
    # until then describe a replica that is gone.
    failed_at: float | None = None
    # When the replica last refused a request at its queue bound (wall clock): full until a
    # report made after that says otherwise.
    full_at: float | None = None

    @property
    def load(self) -> ReplicaLoad | None:
        return None if self.prepared is None else self.prepared.load

    def unreported_hints(self) -> list[RouteHint]:
        return [hint for _, hint in self.unreported]


class FleetBook:
    """The router's view of the fleet. Not thread-safe: Ray Serve's router calls the events and
    the ranking from its own loop (a thread of its own in the ingress's process); the
    ingress's loop reads views of it (admission, /health, /metrics, `room`, `has_room`) over
    snapshots of `replicas`, and marks a replica full or failed (single assignments), which at
    worst ranks one request on the state just before."""

    def __init__(self, *, report_period_s: float = DEFAULT_REPORT_PERIOD_S,
                 stale_after_s: float | None = None, send_skew_s: float = SEND_SKEW_S,
                 seed: int | None = None,
                 served_prefix_blocks: int = DEFAULT_SERVED_PREFIX_BLOCKS,
                 arrival_window_s: float | None = None) -> None:
        self.report_period_s = report_period_s
        self.arrival_window_s = (ARRIVAL_WINDOW_PERIODS * report_period_s
                                 if arrival_window_s is None else arrival_window_s)
        self.served_prefix_blocks = served_prefix_blocks
        self.stale_after_s = (STALE_AFTER_PERIODS * report_period_s if stale_after_s is None
                              else stale_after_s)
        self.send_skew_s = send_skew_s
        self.replicas: dict[str, ReplicaState] = {}
        self.rng = random.Random(seed)
        self._round_robin = 0
        # The slack ranking's predictions for the request it ranked last: (its id, replica id
        # -> prediction), so that on_sent need not predict again on the replica chosen.
        self._ranked: tuple[str, dict[str, Prediction]] = ("", {})
        # Request id -> its predicted TTFT on the replica it was sent to, as the router saw it
        # then, until the ingress takes it for the response (routed_prediction); the oldest
        # are dropped past ROUTED_PREDICTIONS_KEPT (a request whose response never started).
        self.routed_ttft_s: OrderedDict[str, float] = OrderedDict()
        # Decisions the router (engine.fleet.ray_router) failed to make, by exception type:
        # kept here, where the ingress's /metrics reads them (engine.fleet.fleet_metrics).
        self.ranking_failures: Counter[str] = Counter()

    # -- events ------------------------------------------------------------------------------

    def _state(self, replica_id: str) -> ReplicaState:
        state = self.replicas.get(replica_id)
        if state is None:
            state = self.replicas[replica_id] = ReplicaState(
                arrivals=RecentArrivals(self.arrival_window_s,
                                        MIN_SPAN_PERIODS * self.report_period_s))
        return state

    def on_report(self, replica_id: str, load: ReplicaLoad) -> None:
        """A replica's new report. An older one than the report held (reordered delivery) is
        ignored. Requests sent before it was made (less the skew allowance) are in it now."""
        state = self._state(replica_id)
        if state.load is not None and load.made_at < state.load.made_at:
            return
        if state.failed_at is not None and load.made_at <= state.failed_at:
            return
        state.prepared = PreparedLoad(load)
        if state.full_at is not None and load.made_at > state.full_at:
            state.full_at = None
        cutoff = load.made_at - self.send_skew_s
        state.unreported = [(at, hint) for at, hint in state.unreported if at >= cutoff]

    def on_chosen(self, replica_id: str, hint: RouteHint, now: float) -> None:
        """`hint` is on its way to the replica: ranked first there, its send not yet confirmed
        (Ray Serve's router hears the replica accept it a round trip later, and ranks the
        requests that arrive meanwhile). Counted there as sent since the report until
        `on_sent` confirms it (there or elsewhere), `on_unchosen`, or a report made after
        `now` less the skew allowance, which would count it if it got there. Without it a
        burst ranked inside one round trip sees the same book and piles onto one replica."""
        if hint.request_id:
            self._state(replica_id).unreported.append((now, hint))

    def on_unchosen(self, request_id: str) -> None:
        """The request's choice is void (it is ranked again: the replica refused it)."""
        if request_id:
            self._drop_unreported(request_id)

    def _drop_unreported(self, request_id: str) -> None:
        for state in list(self.replicas.values()):
            if any(h.request_id == request_id for _, h in state.unreported):
                state.unreported = [(at, h) for at, h in state.unreported
                                    if h.request_id != request_id]

    def on_sent(self, replica_id: str, hint: RouteHint, now: float) -> None:
        """`hint` was sent to the replica: it queues there from now (its `on_chosen` entry,
        wherever that was, gives way to this). Its predicted TTFT there (whatever the policy
        that chose the replica) is kept for routed_prediction; with an objective, it joins the
        replica's recent arrivals, at its predicted prefill there."""
        if hint.request_id:
            self._drop_unreported(hint.request_id)
        p: Prediction | None = None
        if hint.request_id and self.is_fresh(replica_id, now):
            ranked_id, ranked = self._ranked
            p = ranked.get(replica_id) if ranked_id == hint.request_id else None
            if p is None:
                p = self.predict(replica_id, hint, now)
            if p is not None:
                self.routed_ttft_s[hint.request_id] = p.ttft_s
                while len(self.routed_ttft_s) > ROUTED_PREDICTIONS_KEPT:
                    self.routed_ttft_s.popitem(last=False)
        state = self._state(replica_id)
        if hint.ttft_slo_s is not None:
            if p is not None:
                state.arrivals.add(now, hint.ttft_slo_s, p.prefill_s)
            elif state.load is not None:  # a stale report: its model still prices it
                state.arrivals.add(now, hint.ttft_slo_s,
                                   prefill_seconds(state.load, max(1, hint.prompt_tokens)))
        state.unreported.append((now, hint))
        state.in_flight[hint.request_id] = hint.prefix_hashes

    def routed_prediction(self, request_id: str) -> float | None:
        """The predicted TTFT (seconds from arrival) of the request on the replica it was sent
        to, taken once; None if it was not routed on a fresh report."""
        return self.routed_ttft_s.pop(request_id, None)

    def on_completed(self, replica_id: str, request_id: str) -> None:
        state = self.replicas.get(replica_id)
        if state is None:
            return
        prefix = state.in_flight.pop(request_id, None)
        state.unreported = [(at, h) for at, h in state.unreported if h.request_id != request_id]
        if prefix:
            self._remember_served(state, prefix)

    def _remember_served(self, state: ReplicaState, prefix: list[int]) -> None:
        served = state.served_prefixes
        for h in prefix:
            served[h] = None
            served.move_to_end(h)
        limit = self.served_prefix_blocks
        if state.load is not None and state.load.num_blocks > 0:
            limit = min(limit, state.load.num_blocks)
        while len(served) > limit:
            served.popitem(last=False)

    def on_failed(self, replica_id: str, now: float) -> None:
        """A request saw the replica fail (its stream broke): it is not predicted on, and ranks
        with the stale ones, until it reports again after `now`. Ray Serve notices a dead
        replica's actor later (its health check, the controller's loop); until then the
        router would keep sending there and /health would call the fleet whole."""
        state = self._state(replica_id)
        state.prepared = None
        state.failed_at = now

    def on_full(self, replica_id: str, now: float) -> None:
        """The replica refused a request at its queue bound: it ranks after the replicas with
        room until it reports again after `now`."""
        state = self.replicas.get(replica_id)
        if state is not None:  # not one the router has dropped (a replica scaled down)
            state.full_at = now

    def on_removed(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)

    # -- views -------------------------------------------------------------------------------

    def is_fresh(self, replica_id: str, now: float) -> bool:
        """Whether the replica has reported within `stale_after_s`: only then is it predicted
        on (a replica that stopped reporting may be dead, hung or partitioned)."""
        state = self.replicas.get(replica_id)
        return (state is not None and state.load is not None
                and now - state.load.made_at <= self.stale_after_s)

    def in_flight(self, replica_id: str) -> int:
        state = self.replicas.get(replica_id)
        return 0 if state is None else len(state.in_flight)

    def load_of(self, replica_id: str) -> int:
        """Requests at the replica as far as the router can tell: those its report counts plus
        those sent since, or the router's own in-flight requests where that is more (a missing
        or stale report, or requests the report has not caught up with)."""
        state = self.replicas.get(replica_id)
        if state is None:
            return 0
        reported = 0 if state.load is None else state.load.num_requests + len(state.unreported)
        return max(reported, len(state.in_flight))

    def has_room(self, replica_id: str) -> bool:
        """Whether the replica would take one more request under its queue bound, as far as
        the router can tell (no report, or no bound: it would)."""
        left = self._places_left(replica_id)
        return left is None or left > 0

    def _places_left(self, replica_id: str) -> int | None:
        """Requests the replica would still take under its queue bound (0 after a 429 at it
        since its last report); None: unbounded, or nothing known of it."""
        state = self.replicas.get(replica_id)
        if state is None:
            return None
        if state.full_at is not None:
            return 0
        bound = None if state.load is None else state.load.max_queued_requests
        return None if bound is None else max(0, bound - self.load_of(replica_id))

    def room(self, now: float) -> int | None:
        """How many more requests the fleet would take under its replicas' queue bounds, as far
        as the router can tell; None when it cannot tell (no replica known, or one without a
        fresh report or without a bound)."""
        if not self.replicas:
            return None
        total = 0
        for rid in list(self.replicas):  # a snapshot: see the class's docstring
            left = self._places_left(rid)
            if left is None or not self.is_fresh(rid, now):
                return None
            total += left
        return total

    def queue_score(self, replica_id: str) -> int:
        """vLLM's data-parallel balancing score, `waiting * 4 + running`: the report's waiting
        plus the requests sent since it (they are waiting when they arrive), its running
        (prefilling and decoding). Without a report: the in-flight requests, as waiting."""
        state = self.replicas.get(replica_id)
        if state is None:
            return 0
        load = state.load
        if load is None:
            return 4 * len(state.in_flight)
        waiting = len(load.waiting) + len(state.unreported)
        return 4 * waiting + len(load.running) + load.num_decoding

    def prefix_blocks(self, replica_id: str, hint: RouteHint) -> int:
        """Leading blocks of `hint`'s prompt the replica holds (or will, once the requests sent
        there since its report are prefilled)."""
        state = self.replicas.get(replica_id)
        if state is None or state.prepared is None:
            return 0
        extra: set[int] = set()
        for _, sent in state.unreported:
            extra.update(sent.prefix_hashes)
        return state.prepared.prefix_hit_blocks(hint, extra, state.served_prefixes)

    def predict(self, replica_id: str, hint: RouteHint, now: float) -> Prediction | None:
        """`hint`'s prediction on the replica (None: no report)."""
        state = self.replicas.get(replica_id)
        if state is None or state.prepared is None:
            return None
        return predict(state.prepared, state.unreported_hints(), hint, now,
                       served=state.served_prefixes,
                       overtakers=state.arrivals.overtakers(now))

    def predictions(self, candidate_ids: Sequence[str], hint: RouteHint, now: float
                    ) -> dict[str, Prediction]:
        """Predictions on the fresh candidates."""
        out: dict[str, Prediction] = {}
        for rid in candidate_ids:
            if self.is_fresh(rid, now):
                prediction = self.predict(rid, hint, now)
                if prediction is not None:
                    out[rid] = prediction
        return out

    def loads(self) -> dict[str, ReplicaLoad]:
        """Each replica's latest report (for the fleet's /metrics). Safe to call from another
        thread than the router's: a snapshot of the dict, whose values are immutable."""
        return {rid: state.load for rid, state in list(self.replicas.items())
                if state.load is not None}

    def fresh_and_stale(self, now: float) -> tuple[list[str], list[str]]:
        """The replicas that reported within `stale_after_s`, and those that did not (for the
        fleet's /health)."""
        ids = list(self.replicas)
        fresh = [rid for rid in ids if self.is_fresh(rid, now)]
        return fresh, [rid for rid in ids if rid not in set(fresh)]

    # -- ranking -----------------------------------------------------------------------------

    def rank(self, policy: RouterPolicy, candidate_ids: Sequence[str], hint: RouteHint,
             now: float, predictions: dict[str, Prediction] | None = None) -> list[list[str]]:
        """`candidate_ids` ranked for `hint` under `policy`, most preferred first, one replica
        per rank, every candidate exactly once. `predictions`: the slack policy's, when the
        caller has them already (admission computes the same)."""
        ids = list(dict.fromkeys(candidate_ids))  # duplicates once, in the given order
        if not ids:
            return []
        if policy == "slack":
            ordered = self._rank_slack(ids, hint, now, predictions)
        elif policy == "pow2":
            ordered = self._pow2(ids, self.in_flight)
        elif policy == "least-queue":
            ordered = sorted(ids, key=self.queue_score)
        elif policy == "round-robin":
            ordered = sorted(ids)
            start = self._round_robin % len(ordered)
            self._round_robin += 1
            ordered = ordered[start:] + ordered[:start]
        elif policy == "prefix":
            ordered = sorted(ids, key=lambda rid: (-self.prefix_blocks(rid, hint),
                                                   self.queue_score(rid)))
        else:
            raise ValueError(f"router policy must be one of {ROUTER_POLICIES}, got {policy!r}")
        full = [rid for rid in ordered if not self.has_room(rid)]
        if full:
            ordered = [rid for rid in ordered if rid not in full] + full
        return [[rid] for rid in ordered]

    def _pow2(self, ids: list[str], load) -> list[str]:
        """Power of two choices: two replicas at random, the less loaded first; the rest after
        them in random order (fallbacks only)."""
        shuffled = ids[:]
        self.rng.shuffle(shuffled)
        head = sorted(shuffled[:2], key=load)
        return head + shuffled[2:]

    def _affinity(self, replica_id: str, prediction: Prediction, hint: RouteHint) -> int:
        """The blocks of the prompt the replica holds, where they are a share of it worth
        following (PREFIX_AFFINITY_SHARE); else 0."""
        load = self.replicas[replica_id].load
        block_size = load.block_size if load is not None else 16
        cached_tokens = prediction.cached_blocks * block_size
        if cached_tokens < PREFIX_AFFINITY_SHARE * max(1, hint.prompt_tokens):
            return 0
        return prediction.cached_blocks

    def _at_risk(self, replica_id: str, prediction: Prediction, hint: RouteHint) -> bool:
        """Whether the predicted first token misses the objective once the replica's model
        error (at least MIN_RISK_MARGIN) is added to it."""
        load = self.replicas[replica_id].load
        error = max(MIN_RISK_MARGIN, load.step_model.relative_error if load else 0.0)
        return (hint.ttft_slo_s is not None
                and prediction.ttft_s * (1.0 + error) > hint.ttft_slo_s)

    def _rank_slack(self, ids: list[str], hint: RouteHint, now: float,
                    predictions: dict[str, Prediction] | None) -> list[str]:
        fresh = [rid for rid in ids if self.is_fresh(rid, now)]
        fresh_set = set(fresh)
        stale = sorted((rid for rid in ids if rid not in fresh_set), key=self.load_of)
        if hint.ttft_slo_s is None:
            return self._pow2(fresh, self.load_of) + stale
        known = dict(predictions or {})
        for rid in fresh:
            if rid not in known:
                p = self.predict(rid, hint, now)
                assert p is not None  # fresh: it has a report
                known[rid] = p
        self._ranked = (hint.request_id, known)

        def key(rid: str) -> tuple[int, bool, int, float]:
            p = known[rid]
            # Among replicas that cause as few misses: one that meets the objective with its
            # model's error to spare; then the prefix cache where it holds a good share of the
            # prompt (work saved, a conversation kept in one place); then the least wait
            # in all: its own first token plus what the prefills it goes ahead of (a stopped
            # one included) wait for it (those near their deadlines one by one, the rest as
            # one: Prediction.delay_to_others_s). With its own TTFT alone, an idle replica and
            # a busy one it would interrupt tie to within the two replicas' model noise, and a
            # burst piles onto the replica that already stopped its prefill for the first turn.
            return (p.added_misses, self._at_risk(rid, p, hint), -self._affinity(rid, p, hint),
                    p.ttft_s + p.delay_to_others_s)

        return sorted(fresh, key=key) + stale
