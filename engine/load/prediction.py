"""A request's predicted TTFT on one replica: inserted into that replica's queue, ordered as that
replica's monitor orders it, prefilled with that replica's step model (docs/design.md, section 10).

The replica's report (`ReplicaLoad`) is aged to `now` (the running step's remaining time and
every deadline shrink by `now - made_at`), the requests the router sent there since the report
was made join its queue, and the queue is ordered by the monitor's own functions
(`monitor.policy.urgency` and `order`: rescuable by priority, doomed ones merged where the
rescuable ones' slack allows, no deadline last, first come first served), with the urgencies
the requests will have when the queue starts (the monitor ranks when it schedules the next
prefill, after the running step: a request rescuable now may be doomed by then). The jobs are then
prefilled one after another, each in chunks of the replica's step budget (`prefill_seconds`:
`step_model.predict_step` per chunk): the replica batches prefills with its decodes, and the
decode context is what every prefill step carries.

The running step either finishes first (`step_remaining_s`), or, when it is preemptible, the
replica has SLO preemption on and the monitor's gate (`should_slo_preempt`, with its necessity
test) lets the best waiter stop it, is stopped after PREEMPT_LATENCY_S and its remaining work
joins the queue in slack order (a suspended pass resumes at its layer: nothing is recomputed).

What arrives after the request and is due before it (urgent turns overtaking a document) is
the router's forecast from the replica's recent traffic (engine.load.arrivals), given as
`overtakers`: it lengthens the point estimate, not the optimistic bound.

`served_first` is the request's TTFT with nothing of the queue ahead of it: the running step's
end (or its stop, where it can be stopped), then its own prefill. One server's `--on-doomed
reject` refuses a request that misses its objective even so (engine.serving.doomed).

Not modelled, on purpose: the KV capacity (a replica short of blocks reports a long queue
anyway), and aging (the report does not carry the replica's aging bound, and an aged request is
a miss whichever order it then gets).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from engine.load.arrivals import Overtakers
from engine.load.load_report import ReplicaLoad, RouteHint
from engine.load.prefix_hashes import cached_prefix_blocks
from monitor.policy import AGED_PRIORITY, lendable_slack, order, should_slo_preempt
from monitor.step_time_model import predict_prefill

# Seconds from the monitor's decision to stop a preemptible step until the waiter's own prefill
# starts. The vote is read at every attention op, so the step stops at the next layer boundary:
# on average half a layer, at most one. At GPU time scales (section 9) a 24k-token prefill runs
# ~37 ms a layer (32 layers in ~1.2 s), so half a layer is ~18 ms; add the monitor's wake-up and
# the unwind and 20 ms is the expected cost. The report gives the step's remaining time but not
# its layers, so the latency is this constant, capped by the step's remaining time (a step
# about to end costs no more than its end).
PREEMPT_LATENCY_S = 0.020

# The slack ranking's tie-break counts, one by one, the prefills a request delays that are due
# within this many times its own time to deadline (Prediction.delay_to_others_s): for an urgent
# turn the other turns, not the documents behind it. Counting every document made a replica
# holding a deep queue of documents with seconds to spare repel every urgent turn, and one
# replica took 248 turns of a burst trace while the other took 112 (bench/results/HISTORY.md,
# "the router forecasts what will overtake a request").
DELAY_HORIZON = 10.0


def step_overhead_seconds(load: ReplicaLoad) -> float:
    """What an empty prefill step costs the replica (its model's intercept, its decodes'
    reads, its floor): the part of each step of a prefill that a replica batching several
    prompts into one step pays once for all of them."""
    return load.step_model.predict_step(0, 0, load.decode_context)


def marginal_prefill_seconds(load: ReplicaLoad, tokens: int, cost: float,
                             overhead: float) -> float:
    """The part of a `tokens`-token prefill predicted at `cost` seconds that no batching can
    save: `cost` less one step `overhead` (step_overhead_seconds) per chunk of the step budget
    (never below 0). A replica packs short prefills several to a step, so a queue's predicted
    costs, summed, overstate how soon it can at best reach the request behind them; their
    marginal parts do not."""
    budget = load.max_num_batched_tokens
    steps = 1 if budget <= 0 else max(1, -(-tokens // budget))
    return max(0.0, cost - steps * overhead)


def prefill_seconds(load: ReplicaLoad, tokens: int) -> float:
    """Predicted seconds for the replica to prefill `tokens` more tokens of one prompt: in
    chunks of its step budget, beside its decodes, as its own scheduler predicts them
    (monitor.step_time_model.predict_prefill). One step of the whole prompt would charge a document
    one step's fixed cost, and the replicas' refitted models differ most in that cost: the
    router would send documents to the replica whose model puts the least in it."""
    return predict_prefill(load.step_model, tokens, load.decode_context,
                           load.max_num_batched_tokens)


def running_step(load: ReplicaLoad, now: float) -> tuple[float, bool]:
    """(seconds left in the replica's running step at wall-clock `now`, whether its monitor
    can stop it for a waiter: a preemptible step with SLO preemption on that has time left)."""
    step_remaining = max(0.0, load.step_remaining_s - max(0.0, now - load.made_at))
    return step_remaining, (load.step_preemptible and load.slo_preemption
                            and step_remaining > 0)


def soonest_start_s(step_remaining: float, preemptible: bool) -> float:
    """When, at the soonest, the replica can start a waiter's prefill: once the running step is
    stopped for it (PREEMPT_LATENCY_S, never past the step's end) where it can be, else at the
    step's end."""
    return min(step_remaining, PREEMPT_LATENCY_S) if preemptible else step_remaining


@dataclass(frozen=True)
class ServedFirst:
    """A request's TTFT on a replica that serves it before every request it holds: the running
    step ended or stopped for it (soonest_start_s), then its own prefill (its prefix-cache hit
    taken off), chunked at the replica's step budget beside its decodes. From its arrival."""

    # With the step model's prediction: the point estimate.
    ttft_s: float
    # At the model's optimistic speed (StepTimeModel.optimistic): no order of the queue does
    # better, so a request that misses its objective here is doomed on this replica.
    optimistic_ttft_s: float
    # Seconds left in the running step (0: idle).
    step_remaining_s: float


def served_first(load: ReplicaLoad, prompt_tokens: int, cached_tokens: int, now: float,
                 waited_s: float = 0.0) -> ServedFirst:
    """`prompt_tokens` (of which `cached_tokens` in the prefix cache) served first on the
    replica that reported `load`, at wall-clock `now`, `waited_s` after the request arrived."""
    step_remaining, preemptible = running_step(load, now)
    start = soonest_start_s(step_remaining, preemptible)
    # A fully cached prompt still computes its last token (the engine recomputes it).
    prefill = prefill_seconds(load, max(prompt_tokens - cached_tokens, 1))
    waited = max(0.0, waited_s)
    return ServedFirst(ttft_s=waited + start + prefill,
                       optimistic_ttft_s=waited + start + load.step_model.optimistic(prefill),
                       step_remaining_s=step_remaining)


class _Urgency:
    """monitor.policy.Urgency's fields, in a slotted class: `order` and `should_slo_preempt`
    read only these attributes and the two properties, and a routing decision builds hundreds of them (the frozen
    dataclass's constructor alone would take a fifth of the budget)."""

    __slots__ = ("time_to_deadline", "slack", "priority", "doomed", "prefill")

    def __init__(self, time_to_deadline: float, slack: float, priority: float,
                 doomed: bool = False, prefill: float = 0.0) -> None:
        self.time_to_deadline = time_to_deadline
        self.slack = slack
        self.priority = priority
        self.doomed = doomed
        self.prefill = prefill

    @property
    def aged(self) -> bool:
        return self.priority >= AGED_PRIORITY

    @property
    def lendable_slack(self) -> float:
        return lendable_slack(self.time_to_deadline, self.prefill)


# Urgency of a job without a deadline (policy.urgency's answer for one), shared: no allocation.
_FREE = _Urgency(math.inf, math.inf, 0.0)


class PreparedLoad:
    """A report and what every routing decision reads of it, computed once per report: the set
    of its cached prefix hashes and each waiting request's predicted prefill. Decisions then
    cost arithmetic, not model evaluations (< 1 ms for 8 replicas of ~32 requests each)."""

    __slots__ = ("load", "cached", "timed", "free", "step_overhead")

    def __init__(self, load: ReplicaLoad) -> None:
        self.load = load
        self.cached: frozenset[int] = frozenset(load.cached_prefix_hashes)
        model = load.step_model
        # Once per report: every job's marginal prefill (the optimistic bound) subtracts it.
        self.step_overhead = step_overhead_seconds(load)
        # Waiting requests with a deadline: (prefill, optimistic prefill, time to deadline at
        # made_at, marginal prefill); their urgency depends on the report's age, so each
        # decision computes it.
        self.timed: list[tuple[float, float, float, float]] = []
        # Those without one, first come first served: fixed jobs, built once.
        self.free: list[_Job] = []
        for q in load.waiting:
            prefill = prefill_seconds(load, q.remaining_prefill_tokens)
            marginal = marginal_prefill_seconds(load, q.remaining_prefill_tokens, prefill,
                                                self.step_overhead)
            if q.time_to_deadline_s is None:
                self.free.append(_Job(prefill, prefill, (), _FREE, marginal=marginal))
            else:
                self.timed.append((prefill, model.optimistic(prefill), q.time_to_deadline_s,
                                   marginal))

    def prefix_hit_tokens(self, hint: RouteHint, extra_cached: Collection[int] = (),
                          served: Collection[int] = ()) -> int:
        """Prompt tokens of `hint` this replica holds in its prefix cache (whole blocks), counting
        the prefixes of requests sent there since the report (`extra_cached`) as cached: they
        will be by the time this request's prefill starts behind them; and those the router
        remembers serving there (`served`: engine.fleet.routing's memory)."""
        return self.prefix_hit_blocks(hint, extra_cached, served) * self.load.block_size

    def prefix_hit_blocks(self, hint: RouteHint, extra_cached: Collection[int] = (),
                          served: Collection[int] = ()) -> int:
        if not extra_cached and not served:
            return cached_prefix_blocks(hint.prefix_hashes, self.cached)
        hit = 0
        for h in hint.prefix_hashes:
            if h not in self.cached and h not in extra_cached and h not in served:
                break
            hit += 1
        return hit


@dataclass(frozen=True)
class Prediction:
    """A request's predicted outcome on one replica, and what it does to those queued there."""

    # Predicted TTFT of the request, from its arrival (hint.arrived_at): point estimate.
    ttft_s: float
    # The bound admission uses: the running step stopped for the request where it can be
    # (after PREEMPT_LATENCY_S; else its end), then only the marginal work of the prefills the
    # replica's order puts ahead of it (all of them packed into its own steps: no step overhead
    # of theirs counted) and its own prefill, all at model.optimistic.
    optimistic_ttft_s: float
    # Deadline misses among the replica's requests (the running ones included) without and
    # with the request (which counts itself), and their summed lateness in seconds.
    misses_before: int
    misses_after: int
    lateness_before_s: float
    lateness_after_s: float
    # Leading prompt blocks the replica already holds (its prefix-cache hit).
    cached_blocks: int
    # Whether the request's arrival makes the replica stop its running step.
    preempts: bool
    # Seconds from now until the replica's queue (without the request) has been prefilled.
    drain_s: float
    # The wait it adds to the replica's other prefills: its own prefill, once for each that it
    # goes ahead of (the stopped one included) and is due within DELAY_HORIZON times its
    # objective, and once for all the others.
    delay_to_others_s: float = 0.0
    # Its own predicted prefill there (its prefix-cache hit taken off).
    prefill_s: float = 0.0
    # Of ttft_s, the expected prefills of requests that will arrive after it and be due before
    # it (engine.load.arrivals; 0 without a forecast).
    overtaken_s: float = 0.0

    @property
    def added_misses(self) -> int:
        """Misses the request adds, its own included. Negative where its arrival stops the
        running step and the queue then served in slack order saves a waiter the gate alone
        left behind the step (tests/fleet/test_prediction.py has one)."""
        return self.misses_after - self.misses_before

    @property
    def added_lateness_s(self) -> float:
        return self.lateness_after_s - self.lateness_before_s


class _Job:
    """One prefill as the simulation runs it: its predicted cost (and at best), its deadlines
    (seconds from now; the running step's job carries one per request it serves) and its
    urgency at the decision's `base` time (see predict): computed once, used by both runs."""

    __slots__ = ("cost", "optimistic", "deadlines", "urgency", "new", "marginal", "step",
                 "_later")

    def __init__(self, cost: float, optimistic: float, deadlines: tuple[float, ...],
                 urgency: _Urgency, new: bool = False, marginal: float | None = None,
                 step: bool = False) -> None:
        self.cost = cost
        self.optimistic = optimistic
        self.deadlines = deadlines
        self.urgency = urgency
        self.new = new
        # Its cost less what batching with others could save (marginal_prefill_seconds).
        self.marginal = cost if marginal is None else marginal
        # The running step, or its rest after a stop: the optimistic bound assumes the new
        # request stops it, so it never counts as ahead there.
        self.step = step
        self._later: tuple[float, _Urgency] | None = None

    def urgency_after(self, shift: float) -> _Urgency:
        """Its urgency `shift` seconds from now (its most urgent deadline's); the last one is
        kept, since both runs of a decision (without and with the request) rank at the same
        time."""
        if not self.deadlines:
            return _FREE
        if self._later is not None and self._later[0] == shift:
            return self._later[1]
        u = _urgency(min(self.deadlines) - shift, self.cost, self.optimistic)
        self._later = (shift, u)
        return u


def _urgency(time_to_deadline: float | None, prefill: float, optimistic_prefill: float
             ) -> _Urgency:
    """monitor.policy.urgency for a request whose remaining prefill is predicted to take
    `prefill` seconds (`optimistic_prefill` at best) and whose deadline is `time_to_deadline`
    from now: the same formula, without its aging (see the module's docstring) and without
    building a RequestView and a predictor call per job, which the routing budget cannot
    afford (tests/fleet/test_prediction.py checks the two agree)."""
    if time_to_deadline is None:
        return _FREE
    slack = time_to_deadline - prefill
    best_case = optimistic_prefill if optimistic_prefill < prefill else prefill
    doomed = time_to_deadline - best_case <= 0
    if time_to_deadline == 0:
        return _Urgency(0.0, slack, -math.inf, doomed=True, prefill=prefill)
    return _Urgency(time_to_deadline, slack,
                   (-1.0 if doomed else 1.0) / abs(time_to_deadline), doomed=doomed,
                   prefill=prefill)


def _head(timed: Sequence[_Job]) -> _Urgency | None:
    """The urgency of `order(timed)[0]` without sorting: the gate asks only for the head, and the
    router cannot afford a second sort per replica. `timed`: jobs with deadlines, none aged (see
    the module's docstring). In `order`, the doomed job with the earliest deadline goes first
    iff the least lendable slack among the rescuable ones covers its prefill; else the
    rescuable one of highest priority (ties: the first given, as order's stable sorts keep
    them).
    tests/fleet/test_prediction.py checks it against order."""
    doomed: _Urgency | None = None
    best: _Urgency | None = None
    least_slack = math.inf
    for job in timed:
        u = job.urgency
        if u.doomed:
            if doomed is None or u.time_to_deadline < doomed.time_to_deadline:
                doomed = u
        else:
            if best is None or u.priority > best.priority:
                best = u
            least_slack = min(least_slack, u.lendable_slack)
    if doomed is not None and least_slack >= doomed.prefill:
        return doomed
    return best if best is not None else doomed


def _gate_opens(timed: Sequence[_Job], running: _Urgency, margin: float,
                step_remaining_s: float, relative_error: float) -> bool:
    """Whether the replica's monitor stops its running step for one of the waiters with a
    deadline, `timed`: its choose_slo_preemption (conservative, the default) on urgencies
    already computed. `running`: the most urgent request of the running step (the conservative
    gate weighs the waiter against it)."""
    head = _head(timed)
    if head is None:
        return False
    if head.doomed and should_slo_preempt(head, running, margin,  # type: ignore[arg-type]
                                          step_remaining_s, relative_error):
        return True
    best = max((job.urgency for job in timed), key=lambda u: u.priority)
    if best.doomed:
        return False
    # Necessity: a waiter whose slack covers the rest of the step (and the model's error on
    # both) loses nothing by waiting for it.
    if best.slack >= step_remaining_s + relative_error * (best.prefill + step_remaining_s):
        return False
    return should_slo_preempt(best, running, margin)  # type: ignore[arg-type]


def _run(jobs: Sequence[_Job], start: float, horizon: float = math.inf
         ) -> tuple[int, float, float, float, int]:
    """Prefill `jobs` one after another from `start`: (misses, lateness, the new job's finish
    (nan without one), the last finish, how many prefills the new job delays, as the slack
    ranking's tie-break weighs them: each one due within `horizon` seconds from now, and all
    the others as one)."""
    t = start
    misses = 0
    lateness = 0.0
    new_finish = math.nan
    near = 0
    far = 0
    for job in jobs:
        t += job.cost
        for deadline in job.deadlines:
            if t > deadline:
                misses += 1
                lateness += t - deadline
        if job.new:
            new_finish = t
        elif new_finish == new_finish:  # not nan: the new job is ahead of this one
            if job.deadlines and min(job.deadlines) <= horizon:
                near += 1
            else:
                far += 1
    return misses, lateness, new_finish, t, near + min(far, 1)


def _ranked(jobs: Sequence[_Job], start: float, base: float) -> list[_Job]:
    """`jobs` in the order the replica's monitor gives them when it schedules the next prefill,
    `start` seconds from now (monitor.policy.order on their urgencies then: ranked now, a
    request late by the time the running step ends would pass for rescuable). `base`: when
    the jobs' `urgency` was taken."""
    if start == base:
        scored = [(job.urgency, job) for job in jobs]
    else:
        scored = [(job.urgency_after(start), job) for job in jobs]
    return [job for _, job in order(scored)]  # type: ignore[arg-type]


def _schedule(timed: list[_Job], free: list[_Job], running: _Job | None,
              step_remaining: float, preemptible: bool, load: ReplicaLoad, base: float
              ) -> tuple[float, list[_Job], bool]:
    """When the queue starts and in what order: (start, jobs, whether the step is stopped).
    `timed`: the waiters with a deadline; `free`: those without, first come first served,
    which the monitor's order puts after all of them (so they skip the sort)."""
    if running is None:
        return 0.0, _ranked(timed, 0.0, base) + free, False
    if preemptible and _gate_opens(timed, running.urgency, load.preempt_margin,
                                   step_remaining, load.step_model.relative_error):
        latency = min(step_remaining, PREEMPT_LATENCY_S)
        # The interrupted pass resumes at its layer later: its remaining work joins the queue.
        rest_cost = step_remaining - latency
        rest = _Job(rest_cost, load.step_model.optimistic(rest_cost), running.deadlines,
                    running.urgency, step=True)
        if rest.deadlines:
            return latency, _ranked([rest, *timed], latency, base) + free, True
        return latency, [*_ranked(timed, latency, base), rest, *free], True
    return 0.0, [running, *_ranked(timed, step_remaining, base), *free], False


def predict(load: ReplicaLoad | PreparedLoad, unreported: Sequence[RouteHint], hint: RouteHint,
            now: float, served: Collection[int] = (),
            overtakers: Overtakers | None = None) -> Prediction:
    """`hint`'s predicted TTFT on the replica that reported `load`, to which the router has
    sent `unreported` since the report was made (oldest first), at wall-clock `now`. `served`:
    prefix hashes the router remembers the replica caching, beside its report's.
    `overtakers`: the replica's recent sends, the forecast of what will overtake the request
    (engine.load.arrivals; None: nothing)."""
    prepared = load if isinstance(load, PreparedLoad) else PreparedLoad(load)
    load = prepared.load
    model = load.step_model
    age = max(0.0, now - load.made_at)
    step_remaining, preemptible = running_step(load, now)

    running: _Job | None = None
    if step_remaining > 0 or load.running:
        # The running step: its requests' first tokens come out when it ends. Its urgency is
        # that of its most urgent request (what the conservative gate weighs a waiter against).
        deadlines = tuple(q.time_to_deadline_s - age for q in load.running
                          if q.time_to_deadline_s is not None)
        ttd = min(deadlines) if deadlines else None
        best_case = model.optimistic(step_remaining)
        running = _Job(step_remaining, best_case, deadlines,
                       _urgency(ttd, step_remaining, best_case), step=True)
    # When the waiters' urgencies are taken: now where the gate weighs them (a stoppable step),
    # else when the queue starts, where the monitor ranks them (the step's end).
    base = 0.0 if preemptible or running is None else step_remaining

    def sent(h: RouteHint, extra_cached: Collection[int], new: bool = False) -> _Job:
        tokens = max(0, h.prompt_tokens - prepared.prefix_hit_tokens(h, extra_cached, served))
        # A fully cached prompt still computes its last token (the engine recomputes it).
        prefill = prefill_seconds(load, max(tokens, 1))
        marginal = marginal_prefill_seconds(load, max(tokens, 1), prefill,
                                            prepared.step_overhead)
        deadline = h.deadline()
        if deadline is None:
            return _Job(prefill, prefill, (), _FREE, new, marginal)
        best_case = model.optimistic(prefill)
        ttd = deadline - now
        return _Job(prefill, best_case, (ttd,), _urgency(ttd - base, prefill, best_case), new,
                    marginal)

    shift = age + base
    timed = [_Job(prefill, optimistic, (ttd - age,), _urgency(ttd - shift, prefill, optimistic),
                  marginal=marginal)
             for prefill, optimistic, ttd, marginal in prepared.timed]
    free = prepared.free
    extra: set[int] = set()
    if unreported:
        free = free[:]
        for h in unreported:
            job = sent(h, extra)
            (timed if job.deadlines else free).append(job)
            extra.update(h.prefix_hashes)
    new = sent(hint, extra, new=True)

    start, jobs, stopped_before = _schedule(timed, free, running, step_remaining, preemptible,
                                            load, base)
    misses_before, lateness_before, _, drain, _ = _run(jobs, start)
    if new.deadlines:
        start, jobs, stopped_after = _schedule([*timed, new], free, running, step_remaining,
                                               preemptible, load, base)
    else:
        # Without a deadline it goes last and weighs in no gate: the order stands.
        jobs, stopped_after = [*jobs, new], stopped_before
    # The prefills it delays that are due within DELAY_HORIZON times its own objective weigh
    # one each in the tie-break (a burst's turns spread); the rest, documents with seconds to
    # spare, weigh one in all: an idle replica still beats one it would interrupt, but a deep
    # queue of documents does not push every urgent turn to the replica holding fewer.
    horizon = DELAY_HORIZON * new.deadlines[0] if new.deadlines else math.inf
    misses_after, lateness_after, finish, _, behind = _run(jobs, start, horizon)
    overtaken = 0.0
    if overtakers is not None and new.deadlines:
        ttd = new.deadlines[0]
        expected = overtakers.expected_finish(finish, ttd)
        overtaken = expected - finish
        # Its own miss, as `_run` counted it on the queue alone, now on the forecast.
        misses_after += (expected > ttd) - (finish > ttd)
        lateness_after += max(0.0, expected - ttd) - max(0.0, finish - ttd)
        finish = expected

    waited = max(0.0, now - hint.arrived_at)
    first = soonest_start_s(step_remaining, preemptible)
    ahead = 0.0
    for job in jobs:
        if job is new:
            break
        if not job.step:
            ahead += job.marginal
    blocks = prepared.prefix_hit_blocks(hint, extra, served)
    return Prediction(
        ttft_s=waited + finish,
        optimistic_ttft_s=waited + first + model.optimistic(ahead + new.cost),
        misses_before=misses_before, misses_after=misses_after,
        lateness_before_s=lateness_before, lateness_after_s=lateness_after,
        cached_blocks=blocks,
        # Only a stop the new request causes: one that happens without it is in both runs.
        preempts=stopped_after and not stopped_before,
        drain_s=drain,
        # The prefills it goes ahead of (a stopped one included) wait for its own.
        delay_to_others_s=new.cost * behind,
        prefill_s=new.cost, overtaken_s=overtaken)
