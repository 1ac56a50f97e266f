"""Autoscaling on predicted attainment (docs/design.md, section 10): a fleet grows when its urgent
requests are predicted to miss their deadlines, not when a request count crosses a line, and
shrinks when every replica has had slack to spare for a while.

- `AttainmentWindow` (replica side): over a sliding window, each urgent request's outcome (met
  or missed), predicted by the replica's own monitor while it is queued and replaced by the real
  one when its first token goes out, and the replica's minimum slack. `stats` is what the
  replica's `record_autoscaling_stats` returns to Ray Serve, which averages each key per replica
  over its look-back period.
- `decide_replicas` (pure): the decision from every replica's stats, with delays so that a
  burst does not scale and a decision is not undone by the next tick.
- `deadline_autoscaling_policy` / `DeadlineAutoscalingPolicy`: the Ray Serve custom autoscaling
  policy around it. Ray 2.60 passes `policy_kwargs` only to a *class* policy (instantiated once
  with them, then called per tick: ray/serve/_private/autoscaling_state.py,
  _resolve_policy_callable); a plain function gets the context alone. So:
  `AutoscalingPolicy(policy_function="engine.fleet.autoscaling:DeadlineAutoscalingPolicy",
  policy_kwargs={"target_attainment": 0.9, ...})` for options, or
  `policy_function="engine.fleet.autoscaling:deadline_autoscaling_policy"` for the defaults.
Nothing here imports Ray: the context is read by attribute.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

# The `stats` keys (Ray Serve custom metric names).
URGENT_ATTAINMENT = "urgent_attainment"
URGENT_REQUESTS = "urgent_requests"
URGENT_MISSED = "urgent_missed"
MIN_SLACK_S = "min_slack_s"

DEFAULT_WINDOW_S = 30.0
# A replica without an urgent request in the window has all the slack it could want; metrics
# are finite floats, so it reports this (an hour: more than any objective).
MAX_REPORTED_SLACK_S = 3600.0


class AttainmentWindow:
    """One replica's record of its urgent requests' outcomes and its minimum slack over the last
    `window_s` seconds (wall clock, time.time(), as every report of the fleet)."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError(f"window must be positive, got {window_s}")
        self.window_s = window_s
        # request id -> [last update, met, final]; insertion order is first-record order.
        self._outcomes: dict[str, list[Any]] = {}
        # (time, slack) samples, oldest first.
        self._slack: deque[tuple[float, float]] = deque()

    def on_predicted(self, request_id: str, deadline: float, predicted_first_token_at: float,
                     now: float) -> None:
        """An urgent request's predicted outcome while it is queued (the monitor's prediction;
        a later call replaces it). Ignored once its real outcome is in."""
        entry = self._outcomes.get(request_id)
        if entry is not None and entry[2]:
            return
        self._outcomes[request_id] = [now, predicted_first_token_at <= deadline, False]

    def on_first_token(self, request_id: str, deadline: float, at: float) -> None:
        """The real outcome: the request's first token went out at `at`."""
        self._outcomes[request_id] = [at, at <= deadline, True]

    def on_slack(self, min_slack_s: float, now: float) -> None:
        """The replica's minimum slack over its queued urgent requests at `now`."""
        self._slack.append((now, min_slack_s))
        self._prune(now)

    def forget(self, request_id: str) -> None:
        """A request aborted before its first token: neither met nor missed."""
        entry = self._outcomes.get(request_id)
        if entry is not None and not entry[2]:
            del self._outcomes[request_id]

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        while self._slack and self._slack[0][0] < horizon:
            self._slack.popleft()
        stale = [rid for rid, entry in self._outcomes.items() if entry[0] < horizon]
        for rid in stale:
            del self._outcomes[rid]

    def stats(self, now: float) -> dict[str, float]:
        """The window's figures: attainment over its urgent requests (1.0 with none), their
        count, the misses among them, and the least slack seen (MAX_REPORTED_SLACK_S with
        none)."""
        self._prune(now)
        total = len(self._outcomes)
        met = sum(1 for entry in self._outcomes.values() if entry[1])
        slack = min((s for _, s in self._slack), default=MAX_REPORTED_SLACK_S)
        return {
            URGENT_ATTAINMENT: met / total if total else 1.0,
            URGENT_REQUESTS: float(total),
            URGENT_MISSED: float(total - met),
            MIN_SLACK_S: min(slack, MAX_REPORTED_SLACK_S),
        }


@dataclass(frozen=True)
class ScalingOptions:
    # Scale up while the fleet's predicted urgent attainment is below this ...
    target_attainment: float = 0.95
    # ... for this long: one burst of misses is not a capacity shortage, and a new replica takes
    # longer than that to start (weights, warm-up) anyway.
    upscale_delay_s: float = 10.0
    # Scale down once every replica's minimum slack has stayed above this ...
    downscale_slack_s: float = 1.0
    # ... for this long: long enough to see the daily lulls and not the gaps between bursts.
    downscale_delay_s: float = 60.0
    # Fewer urgent requests than this in the window say nothing about capacity (one miss of two
    # would read as 50% attainment).
    min_urgent_requests: float = 5.0
    min_replicas: int = 1
    max_replicas: int = 1 << 30

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> ScalingOptions:
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"unknown autoscaling options {sorted(unknown)}; known: "
                             f"{sorted(known)}")
        return cls(**kwargs)


def fleet_attainment(per_replica_stats: Mapping[str, Mapping[str, float]]
                     ) -> tuple[float, float]:
    """(attainment, urgent requests) over the fleet: each replica's attainment weighted by its
    urgent requests (1.0 with none)."""
    total = met = 0.0
    for stats in per_replica_stats.values():
        n = float(stats.get(URGENT_REQUESTS, 0.0))
        if n > 0:
            total += n
            met += n * float(stats.get(URGENT_ATTAINMENT, 1.0))
    return (met / total if total else 1.0), total


def decide_replicas(current: int, per_replica_stats: Mapping[str, Mapping[str, float]],
                    options: ScalingOptions, state: Mapping[str, Any], now: float
                    ) -> tuple[int, dict[str, Any]]:
    """The target number of replicas and the state to pass to the next call.

    Up by one once attainment (over at least `min_urgent_requests`) has stayed below
    `target_attainment` for `upscale_delay_s`; down by one once every replica's minimum slack
    has stayed above `downscale_slack_s` for `downscale_delay_s` (and attainment is on target).
    Each change restarts both clocks, so the next change needs a whole delay of fresh evidence
    (the new replica's own stats included): no flapping. Always within the bounds."""
    low_since = state.get("low_since")
    slack_since = state.get("slack_since")
    attainment, urgent = fleet_attainment(per_replica_stats)
    low = urgent >= options.min_urgent_requests and attainment < options.target_attainment
    roomy = (bool(per_replica_stats) and not low
             and all(float(s.get(MIN_SLACK_S, -math.inf)) > options.downscale_slack_s
                     for s in per_replica_stats.values()))
    low_since = (now if low_since is None else low_since) if low else None
    slack_since = (now if slack_since is None else slack_since) if roomy else None

    target = current
    if low_since is not None and now - low_since >= options.upscale_delay_s:
        target = current + 1
    elif slack_since is not None and now - slack_since >= options.downscale_delay_s:
        target = current - 1
    target = max(options.min_replicas, min(options.max_replicas, target))
    if target != current:
        low_since = slack_since = None
    return target, {"low_since": low_since, "slack_since": slack_since,
                    "attainment": attainment, "urgent_requests": urgent}


def _per_replica(aggregated: Mapping[str, Mapping[Any, float]] | None
                 ) -> dict[str, dict[str, float]]:
    """Ray's {metric: {replica: value}} as {replica: {metric: value}}."""
    out: dict[str, dict[str, float]] = {}
    for metric, values in (aggregated or {}).items():
        for replica, value in values.items():
            out.setdefault(str(replica), {})[metric] = float(value)
    return out


def deadline_autoscaling_policy(ctx: Any, **options: Any) -> tuple[int, dict[str, Any]]:
    """Ray Serve custom autoscaling policy: (target replicas, policy state).

    Decides from the autoscaler's current target (`ctx.target_num_replicas`, falling back to
    the running replicas): while new replicas start, their count is not yet in
    `current_num_replicas`, and deciding from it would undo a scale-up in progress. Bounds:
    Ray's capacity-adjusted min and max, narrowed by any `min_replicas` / `max_replicas`
    option."""
    opts = ScalingOptions.from_kwargs(options)
    low = int(getattr(ctx, "capacity_adjusted_min_replicas", opts.min_replicas))
    high = int(getattr(ctx, "capacity_adjusted_max_replicas", opts.max_replicas))
    opts = ScalingOptions(**{**asdict(opts), "min_replicas": max(low, opts.min_replicas),
                             "max_replicas": min(high, opts.max_replicas)})
    current = getattr(ctx, "target_num_replicas", None)
    if current is None:
        current = ctx.current_num_replicas
    now = getattr(ctx, "current_time", None)
    if now is None:
        import time
        now = time.time()
    return decide_replicas(int(current), _per_replica(ctx.aggregated_metrics), opts,
                           dict(ctx.policy_state or {}), float(now))


class DeadlineAutoscalingPolicy:
    """The class form, for `policy_kwargs`: Ray instantiates it once with them and calls it
    every tick (the state lives in `ctx.policy_state`, not here)."""

    def __init__(self, **options: Any) -> None:
        ScalingOptions.from_kwargs(options)  # fail at deploy time, not at the first tick
        self.options = options

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        return deadline_autoscaling_policy(ctx, **self.options)
