"""Clairvoyant TTFT-SLO attainment bound for a trace: the limit the measured policies are held to.

A discrete-event simulation of the trace on ONE server whose only work is prefill, costed by the
calibrated predictor (`predict(n)` seconds for n prompt tokens), scheduled by preemptive EDF with
zero-cost, zero-latency preemption that keeps progress. Decode is ignored, as are prefix-cache
hits (trace prompts are distinct). Everything here is at least as favourable as the engine, so
the result is what no scheduler on this engine can be expected to beat.

How it decides, at every arrival and every completion (the only instants where EDF can change):
1. Requests without an SLO get deadline +inf: served after every request that has one, FCFS.
2. A request that cannot meet its deadline even if started now is *doomed* and goes to the back
   (after the feasible ones, before the no-SLO ones; its order there does not change attainment).
   Plain EDF is optimal only when every deadline can be met; with infeasible jobs it wastes the
   server on jobs that will miss and lets them push others past their deadlines (domino effect).
3. `overload="moore-hodgson"` (the default) goes further: among the feasible requests it keeps
   the largest set that EDF can still finish on time if nothing else arrived (Moore-Hodgson: walk
   in deadline order, and whenever one would be late, set aside the longest remaining job so
   far), and puts the rest after them. Without further arrivals this is optimal (1||sum U_j), so
   one long prefill cannot sink several short ones. The set-aside ones are reconsidered at every
   event; a doomed one never recovers (running it moves its finish time and "now" together).
   `overload="edf"` applies only rule 2 (set aside only the doomed).
Neither is an exact optimum over future arrivals (1|r_j,pmtn|sum U_j needs Lawler's dynamic
program); both are bounds in practice because the engine also pays for decode and preemption.

With `budget_tokens`, a prompt longer than the budget is prefilled in budget-sized chunks as the
engine does, each chunk paying the predictor's per-step intercept: cost = sum of predict(chunk).
(Several short prompts sharing one step, and so one intercept, is not modelled.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only attributes are read: any object with the Trace shape works
    from engine.benchmarks.attainment.traces import Trace

# Float slack for deadline comparisons: sums of predictor costs are not exact.
EPS_S = 1e-9


def prefill_cost_s(tokens: int, predict_ttft_s: Callable[[int], float],
                   budget_tokens: int | None = None) -> float:
    """Seconds of server time to prefill `tokens` prompt tokens, chunked at `budget_tokens`."""
    if budget_tokens is None or tokens <= budget_tokens:
        return max(0.0, predict_ttft_s(tokens))
    full, rest = divmod(tokens, budget_tokens)
    cost = full * predict_ttft_s(budget_tokens) + (predict_ttft_s(rest) if rest else 0.0)
    return max(0.0, cost)


def _moore_hodgson(feasible: list[int], now: float, rem: list[float],
                   deadline: list[float]) -> tuple[list[int], list[int]]:
    """Split EDF-ordered `feasible` into (on-time set in EDF order, set-aside jobs)."""
    kept: list[int] = []
    aside: list[int] = []
    t = now
    for j in feasible:
        kept.append(j)
        t += rem[j]
        if t > deadline[j] + EPS_S:
            # Dropping the longest job so far frees the most time for everything after it.
            longest = max(kept, key=lambda k: (rem[k], deadline[k]))
            kept.remove(longest)
            aside.append(longest)
            t -= rem[longest]
    return kept, aside


def simulate_ttft(trace: Trace, predict_ttft_s: Callable[[int], float],
                  budget_tokens: int | None = None,
                  overload: str = "moore-hodgson") -> list[float]:
    """Simulated TTFT (seconds) of every request of `trace`, in trace order."""
    if overload not in ("moore-hodgson", "edf"):
        raise ValueError(f"overload must be 'moore-hodgson' or 'edf', got {overload!r}")
    reqs = trace.requests
    n = len(reqs)
    arrival = [float(r.arrival_s) for r in reqs]
    deadline = [math.inf if r.ttft_slo_ms is None else r.arrival_s + r.ttft_slo_ms / 1000.0
                for r in reqs]
    rem = [prefill_cost_s(len(r.prompt_token_ids), predict_ttft_s, budget_tokens) for r in reqs]
    finish: list[float | None] = [None] * n
    by_arrival = sorted(range(n), key=lambda j: (arrival[j], j))

    live: list[int] = []  # arrived, has a deadline, not yet doomed
    doomed: list[int] = []  # can no longer meet the deadline: permanent, kept in arrival order
    no_slo: list[int] = []  # deadline +inf, FCFS
    t = 0.0
    nxt = 0  # index into by_arrival of the next arrival

    def admit_arrivals() -> None:
        nonlocal nxt
        while nxt < n and arrival[by_arrival[nxt]] <= t:
            j = by_arrival[nxt]
            (no_slo if math.isinf(deadline[j]) else live).append(j)
            nxt += 1

    while nxt < n or live or doomed or no_slo:
        if not (live or doomed or no_slo):
            t = max(t, arrival[by_arrival[nxt]])  # idle until the next arrival
        admit_arrivals()
        for j in [j for j in live if t + rem[j] > deadline[j] + EPS_S]:
            live.remove(j)
            doomed.append(j)
        edf = sorted(live, key=lambda j: (deadline[j], arrival[j], j))
        if overload == "moore-hodgson":
            kept, aside = _moore_hodgson(edf, t, rem, deadline)
            aside.sort(key=lambda j: (deadline[j], arrival[j], j))
            order = kept + aside
        else:
            order = edf
        order += doomed + no_slo
        j = order[0]
        # Run j until it finishes or the next arrival, whichever is first: only then can the
        # EDF choice change (a completion of j or a new job).
        next_arrival = arrival[by_arrival[nxt]] if nxt < n else math.inf
        if t + rem[j] <= next_arrival:
            t += rem[j]
            rem[j] = 0.0
            finish[j] = t
            for queue in (live, doomed, no_slo):
                if j in queue:
                    queue.remove(j)
        else:
            rem[j] -= next_arrival - t
            t = next_arrival
    return [f - a for f, a in zip(finish, arrival)]  # type: ignore[operator]


def clairvoyant_attainment(trace: Trace, predict_ttft_s: Callable[[int], float],
                           budget_tokens: int | None = None,
                           overload: str = "moore-hodgson") -> dict[str, Any]:
    """{"ttft_slo_attainment": overall, "tiers": {tier: attainment}} of the simulated schedule.

    Attainment is over requests with an SLO (None for a tier or trace with none); a request meets
    its SLO when ttft * 1000 <= ttft_slo_ms, the engine's test.
    """
    ttfts = simulate_ttft(trace, predict_ttft_s, budget_tokens, overload)
    met: dict[str, list[bool]] = {}
    tiers: list[str] = []
    for r, ttft in zip(trace.requests, ttfts):
        if r.tier not in tiers:
            tiers.append(r.tier)
        if r.ttft_slo_ms is not None:
            met.setdefault(r.tier, []).append(ttft * 1000.0 <= r.ttft_slo_ms + EPS_S * 1000.0)
    every = [m for ms in met.values() for m in ms]
    return {
        "ttft_slo_attainment": sum(every) / len(every) if every else None,
        "tiers": {t: (sum(met[t]) / len(met[t]) if met.get(t) else None) for t in sorted(tiers)},
        "num_slo_requests": len(every),
        "num_slo_met": sum(every),
        "overload": overload,
        "budget_tokens": budget_tokens,
    }
