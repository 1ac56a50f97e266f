"""`sloserve bench run --replicas N --router slack pow2 ...`: one trace against a fleet per router.

For each router named (and each --on-doomed mode), a fleet of N replicas starts on Ray Serve
(engine/fleet/launch.py: `running_fleet`, one Ray instance shared by all of them and shut down
at the end), the attainment benchmark's HTTP runner replays the trace against its ingress
(streaming; TTFT at the client, to the first chunk carrying text; every prompt salted), and the
fleet is stopped before the next one starts. Each run is an ordinary `RunResult` (runner
"fleet", the router as its policy, `/reject` appended under --on-doomed reject), so
results.json, results.jsonl, summary.md and the plots are the attainment benchmark's own;
`fleet_table` adds the routers side by side (OUTPUT_DIR/fleet.md):

- urgent TTFT attainment: the tier with the tightest median objective;
- goodput: requests that completed and met every objective they carry, per second of the run
  (first arrival to last finish), as `summarize` defines `request_goodput`; and its ratio to
  pow2's and least-queue's on the same trace;
- relaxed completion: the loosest tier's completed requests and their mean end-to-end latency,
  and that latency's change from pow2's;
- TTFT p50/p99 per tier, and the median of client minus server TTFT (what the HTTP path and Ray
  Serve add);
- how the requests spread over the replicas, from each response's `x-sloserve-replica` header
  (counts per replica, largest first);
- under `reject`: the 429s, how many of them carried a predicted TTFT past the request's
  objective, and how many of the same requests missed it when the same router served every
  request (where that run is in the same invocation).
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from engine.benchmarks.attainment.results import RequestResult, RunResult, summarize
from engine.ports import free_port

BASELINES = ("pow2", "least-queue")
# The replicas' environment: a simulated or CPU replica needs no more than a short startup
# calibration (a TTFT line is given to it anyway).
REPLICA_ENV = {"SLOSERVE_STARTUP_CALIBRATION_S": "0.3"}



def run_label(router: str, on_doomed: str) -> str:
    return router if on_doomed == "serve" else f"{router}/{on_doomed}"


def fleet_modes(routers: Sequence[str], on_doomed: Sequence[str]) -> list[tuple[str, str]]:
    """(router, on_doomed) per fleet to run, in order: a bare router name runs under each
    `on_doomed` mode (all routers under the first mode, then under the next); ROUTER/MODE (as
    the table labels a run: `slack/reject`) under that mode only. ValueError for an unknown
    router or mode, or a pair named twice."""
    from engine.fleet.routing import ROUTER_POLICIES

    modes_known = ("serve", "reject")
    bare, pinned = [], []
    for spec in routers:
        router, _, mode = spec.partition("/")
        if router not in ROUTER_POLICIES or (mode and mode not in modes_known):
            raise ValueError(f"--router {spec!r}: expected one of {', '.join(ROUTER_POLICIES)}"
                             f", optionally /{'|'.join(modes_known)}")
        (pinned if mode else bare).append((router, mode))
    out = [(router, mode) for mode in on_doomed for router, _ in bare]
    out += pinned
    if len(set(out)) != len(out):
        raise ValueError(f"--router/--on-doomed name a fleet twice: {routers} x {on_doomed}")
    return out


def fleet_runs(setup: Any, args: Any, trace: Any, budget: int) -> list[RunResult]:
    """The trace against a fresh fleet per (router, on_doomed), one after the other; Ray is
    started by the first and left running for the next (the caller shuts it down:
    `shutdown_ray`)."""
    from engine.benchmarks.attainment.policies import DEFAULT_SERVER_POLICY, resolve_policies
    from engine.benchmarks.attainment.runners import run_http
    from engine.benchmarks.attainment.time_scale import restored_run, slowed_trace
    from engine.config import build_engine_config
    from engine.fleet.launch import running_fleet
    from engine.fleet.options import FleetOptions
    from engine.serving.api_server import ServerSettings

    policy = resolve_policies([DEFAULT_SERVER_POLICY])[0]
    # The replicas cache prefixes, as a served engine does by default (the attainment
    # benchmark turns it off so that no run finds an earlier one's prompts): every fleet here
    # starts empty and the HTTP replay salts each prompt (a conversation's alike), so what a
    # replica finds in its cache is what this trace put there. Affinity is half of routing.
    config = build_engine_config(setup.model, max_num_batched_tokens=budget,
                                 **{**policy.engine_kwargs(), **setup.engine_overrides,
                                    "enable_prefix_caching": True})
    settings = ServerSettings(served_model_name="sloserve-fleet")
    # Ray Serve keeps the HTTP port of its first start while Ray runs: one port for them all.
    args.fleet_port = args.fleet_port or free_port()
    runs = []
    modes = fleet_modes(args.router, args.on_doomed)
    for i, (router, mode) in enumerate(modes):
        label = run_label(router, mode)
        print(f"[fleet {i + 1}/{len(modes)}] {args.replicas} replicas, router {label}",
              file=sys.stderr, flush=True)
        # Slowed down (--time-scale), the replicas report as often in the profile's time as
        # they would at full speed: the router's view is no fresher than a real fleet's.
        options = FleetOptions(replicas=args.replicas, router=router, on_doomed=mode,
                               replica_env=dict(REPLICA_ENV), router_seed=args.router_seed,
                               report_period_s=FleetOptions.report_period_s * setup.time_scale)
        with running_fleet(config, settings, options, port=args.fleet_port,
                           keep_ray=True) as url, HealthSampler(url) as health:
            run = run_http(slowed_trace(trace, setup.time_scale), url, policy, budget,
                           model_name=settings.served_model_name, label=label)
        run = restored_run(run, trace, setup.time_scale)
        run.runner = "fleet"
        run.meta["fleet"] = {"replicas": args.replicas, "router": router, "on_doomed": mode,
                             "router_seed": args.router_seed, "health": health.summary()}
        for kind, record in run.figure_records():
            setup.figures.write(kind, **record)
        runs.append(run)
    return runs


class HealthSampler:
    """Polls the fleet's /health every `period_s` while a replay runs: how often the router's
    book had a replica whose report was stale (engine/fleet/fleet_health.py), per replica."""

    def __init__(self, url: str, period_s: float = 0.5) -> None:
        self.url, self.period_s = url, period_s
        self.samples = 0
        self.with_stale = 0
        self.not_reporting: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="fleet-health", daemon=True)

    def _poll(self) -> None:
        import httpx

        with httpx.Client(timeout=5.0) as client:
            while not self._stop.wait(self.period_s):
                try:
                    report = client.get(f"{self.url}/health").json()
                except (httpx.HTTPError, ValueError):
                    continue
                stale = (report.get("replicas") or {}).get("not_reporting") or []
                self.samples += 1
                self.with_stale += bool(stale)
                self.not_reporting.update(stale)

    def __enter__(self) -> HealthSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)

    def summary(self) -> dict[str, Any]:
        return {"samples": self.samples, "samples_with_stale_report": self.with_stale,
                "not_reporting": dict(self.not_reporting)}


def shutdown_ray() -> None:
    from engine.fleet.launch import stop_fleet

    stop_fleet(shutdown_ray=True)


# ---- the side-by-side table -----------------------------------------------------------------

def _tiers(runs: Sequence[RunResult]) -> tuple[str | None, str | None]:
    """(urgent, relaxed): the tiers with the tightest and the loosest median TTFT objective (a
    tier without objectives counts as the loosest)."""
    slos: dict[str, float] = {}
    for run in runs:
        for tier, s in summarize(run)["tiers"].items():
            slo = s.get("median_ttft_slo_ms")
            slos[tier] = float("inf") if slo is None else min(slo, slos.get(tier, slo))
    if not slos:
        return None, None
    ordered = sorted(slos, key=lambda t: slos[t])
    return ordered[0], (ordered[-1] if len(ordered) > 1 else None)


def _ratio(met: int | None, total: int | None) -> str:
    if not total:
        return "–"
    return f"{met or 0}/{total} ({100.0 * (met or 0) / total:.0f}%)"


def _num(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def spread(run: RunResult, tier: str | None = None) -> str:
    """Requests per replica (largest first) from the x-sloserve-replica header; unanswered
    ones (429s, failures before a replica) are not counted."""
    counts = Counter(r.replica for r in run.requests
                     if r.replica and (tier is None or r.tier == tier))
    return " / ".join(str(n) for _, n in counts.most_common()) or "–"


def rejections(run: RunResult, runs: Sequence[RunResult]) -> dict[str, Any]:
    """The run's 429s; how many carried a predicted TTFT past the objective; and how many of
    the same requests missed their objective in the serve run of the same router and trace."""
    rejected = [r for r in run.requests if r.http_status == 429]
    fleet = run.meta.get("fleet") or {}
    serve = next((o for o in runs if (o.meta.get("fleet") or {}).get("on_doomed") == "serve"
                  and (o.meta.get("fleet") or {}).get("router") == fleet.get("router")
                  and (o.workload, o.rate, o.seed) == (run.workload, run.rate, run.seed)),
                 None)
    predicted_late = sum(1 for r in rejected if r.rejected_predicted_ttft_ms is not None
                         and r.ttft_slo_ms is not None
                         and r.rejected_predicted_ttft_ms > r.ttft_slo_ms)
    missed = None
    if serve is not None:
        by_id = {r.request_id: r for r in serve.requests}
        missed = sum(1 for r in rejected if r.request_id in by_id
                     and by_id[r.request_id].slo_met is False)
    return {"rejected": len(rejected), "predicted_past_slo": predicted_late,
            "missed_under_serve": missed, "serve_run": serve.policy if serve else None}


def _median_tpot_ms(run: RunResult) -> float | None:
    """The run's decode step as its clients saw it: the median TPOT, in ms."""
    tpots = sorted(r.tpot_s for r in run.requests if r.tpot_s is not None)
    return tpots[len(tpots) // 2] * 1000 if tpots else None


def _accepted_with_objective(run: RunResult) -> list[RequestResult]:
    return [r for r in run.requests if r.http_status != 429 and r.ttft_slo_ms is not None]


def _late_past(r: RequestResult, step_ms: float) -> bool:
    assert r.ttft_slo_ms is not None
    return r.ttft_s is None or r.ttft_s * 1000 > r.ttft_slo_ms + step_ms


def late_past_a_decode_step(run: RunResult) -> tuple[int, int, float | None]:
    """(accepted requests with a TTFT objective whose client TTFT missed it by more than one
    decode step, those accepted with an objective, the decode step in ms): the bound on
    what routing may cost an accepted request. The decode step is the run's median TPOT, as
    its clients saw it."""
    step_ms = _median_tpot_ms(run)
    accepted = _accepted_with_objective(run)
    if step_ms is None:
        return 0, len(accepted), None
    return sum(_late_past(r, step_ms) for r in accepted), len(accepted), step_ms


def routing_misses(run: RunResult) -> tuple[int, int] | None:
    """(accepted requests the router predicted in time on the replica it chose, with an
    objective, that missed it by more than a decode step; those predicted in time): the misses
    a routing decision caused rather than foresaw. None where no response carried the router's
    prediction (not a fleet, or a report too old to predict on)."""
    step_ms = _median_tpot_ms(run)
    foreseen = [r for r in _accepted_with_objective(run)
                if r.routed_predicted_ttft_ms is not None]
    if not foreseen or step_ms is None:
        return None
    in_time = [r for r in foreseen if r.routed_predicted_ttft_ms <= r.ttft_slo_ms]
    return sum(_late_past(r, step_ms) for r in in_time), len(in_time)


def _routing_cell(run: RunResult) -> str:
    found = routing_misses(run)
    return "–" if found is None else _ratio(*found)


def _late_cell(run: RunResult) -> str:
    late, accepted, step_ms = late_past_a_decode_step(run)
    return "–" if step_ms is None else f"{_ratio(late, accepted)} ({step_ms:.0f} ms)"


def _staleness(run: RunResult) -> str:
    health = (run.meta.get("fleet") or {}).get("health") or {}
    return _ratio(health.get("samples_with_stale_report"), health.get("samples"))


def _vs(value: float | None, base: float | None, fmt: str) -> str:
    if value is None or not base:
        return "–"
    return fmt.format(value / base)


def fleet_table(runs: Sequence[RunResult]) -> str:
    """One Markdown table per trace: a row per figure, a column per router (and mode)."""
    traces: dict[tuple[str, float, int], list[RunResult]] = {}
    for run in runs:
        traces.setdefault((run.workload, run.rate, run.seed), []).append(run)
    parts = []
    for (workload, rate, seed), group in traces.items():
        urgent, relaxed = _tiers(group)
        sums = {id(r): summarize(r) for r in group}
        by_label = {r.policy: r for r in group}

        def tier(run: RunResult, name: str | None) -> dict[str, Any]:
            return sums[id(run)]["tiers"].get(name, {}) if name else {}

        def goodput(run: RunResult | None) -> float | None:
            return sums[id(run)]["request_goodput"] if run is not None else None

        def relaxed_e2e(run: RunResult | None) -> float | None:
            return tier(run, relaxed).get("mean_e2el_ms") if run is not None else None

        u, x = urgent or "urgent", relaxed or "relaxed"
        rows: list[tuple[str, list[str]]] = [
            (f"{u} TTFT attainment", [_ratio(tier(r, urgent).get("num_slo_met"),
                                             tier(r, urgent).get("num_slo_requests"))
                                      for r in group]),
            ("good (completed, every objective met)",
             [_ratio(sums[id(r)]["num_good"], sums[id(r)]["num_requests"]) for r in group]),
            ("goodput (good req/s)", [_num(goodput(r), 2) for r in group]),
        ]
        for base in BASELINES:
            if base in by_label:
                rows.append((f"goodput vs {base}",
                             [_vs(goodput(r), goodput(by_label[base]), "{:.2f}x")
                              for r in group]))
        rows += [
            (f"{x} completed", [_ratio(tier(r, relaxed).get("completed"),
                                       tier(r, relaxed).get("num_requests")) for r in group]),
            (f"{x} TTFT attainment", [_ratio(tier(r, relaxed).get("num_slo_met"),
                                             tier(r, relaxed).get("num_slo_requests"))
                                      for r in group]),
            (f"{x} mean E2E (s)", [_num((relaxed_e2e(r) or 0) / 1e3 or None, 2)
                                   for r in group]),
        ]
        if "pow2" in by_label:
            base_e2e = relaxed_e2e(by_label["pow2"])
            rows.append((f"{x} mean E2E vs pow2",
                         [_vs(relaxed_e2e(r), base_e2e, "{:.2f}x") for r in group]))
        for name in (urgent, relaxed):
            if name:
                rows.append((f"{name} TTFT p50 / p99 (ms)",
                             [" / ".join(_num(tier(r, name).get(k)) for k in
                                         ("median_ttft_ms", "p99_ttft_ms")) for r in group]))
        rows += [
            ("client − server TTFT p50 (ms)",
             [_num(sums[id(r)]["median_ttft_client_minus_server_ms"]) for r in group]),
            ("requests per replica", [spread(r) for r in group]),
            ("/health samples with a stale replica report", [_staleness(r) for r in group]),
        ]
        for name in (urgent, relaxed):
            if name:
                rows.append((f"{name} per replica", [spread(r, name) for r in group]))
        rej = {id(r): rejections(r, group) for r in group}
        if any((r.meta.get("fleet") or {}).get("on_doomed") == "reject" for r in group):
            rows += [
                ("rejected (429)", [str(rej[id(r)]["rejected"]) for r in group]),
                ("429s predicted past their SLO",
                 [_ratio(rej[id(r)]["predicted_past_slo"], rej[id(r)]["rejected"])
                  for r in group]),
                ("429s that missed when served",
                 [_ratio(rej[id(r)]["missed_under_serve"], rej[id(r)]["rejected"])
                  if rej[id(r)]["missed_under_serve"] is not None else "–" for r in group]),
                ("accepted, late by more than a decode step (median TPOT)",
                 [_late_cell(r) for r in group]),
                ("of those predicted in time where routed: late by more than a decode step",
                 [_routing_cell(r) for r in group]),
            ]
        rows.append(("failed (429 included)", [str(sums[id(r)]["failed"]) for r in group]))
        replicas = {(r.meta.get("fleet") or {}).get("replicas") for r in group}
        scales = sorted({float(r.meta.get("time_scale", 1.0)) for r in group})
        slowed = ("" if scales == [1.0] else
                  f" (run {'/'.join(f'{k:g}' for k in scales)}x slower, figures in the "
                  f"profile's time: --time-scale)")
        head = ["", *(r.policy for r in group)]
        lines = [f"{workload} at {rate:g} req/s, seed {seed}, "
                 f"{'/'.join(str(n) for n in sorted(replicas, key=str))} replicas: the same "
                 f"trace, one fleet per router{slowed}", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join([name, *cells]) + " |" for name, cells in rows]
        targets = target_lines(group, urgent, relaxed)
        parts.append("\n".join(lines + ([""] + targets if targets else [])) + "\n")
    return "\n".join(parts)


def target_lines(runs: Sequence[RunResult], urgent: str | None,
                 relaxed: str | None) -> list[str]:
    """The fleet targets for the slack router against pow2 and least-queue, where those runs
    are present: slack >= 95% urgent attainment, goodput >= 1.3x each, relaxed mean E2E within
    10% of pow2's."""
    by_label = {r.policy: r for r in runs}
    slack = by_label.get("slack")
    if slack is None:
        return []
    s = summarize(slack)
    out = []
    att = s["tiers"].get(urgent, {}).get("ttft_slo_attainment") if urgent else None
    if att is not None:
        out.append(f"- slack {urgent} attainment {att:.0%} (target >= 95%): "
                   f"{'met' if att >= 0.95 else 'not met'}")
    for base in BASELINES:
        if base in by_label:
            b = summarize(by_label[base])["request_goodput"]
            if b and s["request_goodput"] is not None:
                ratio = s["request_goodput"] / b
                out.append(f"- slack goodput {ratio:.2f}x {base}'s (target >= 1.3x): "
                           f"{'met' if ratio >= 1.3 else 'not met'}")
    if relaxed and "pow2" in by_label:
        mine = s["tiers"].get(relaxed, {}).get("mean_e2el_ms")
        theirs = summarize(by_label["pow2"])["tiers"].get(relaxed, {}).get("mean_e2el_ms")
        if mine is not None and theirs:
            change = mine / theirs - 1
            out.append(f"- slack {relaxed} mean E2E {change:+.0%} vs pow2's (target within "
                       f"10%): {'met' if change <= 0.10 else 'not met'}")
    return ["targets:", *out] if out else []


FLEET_NOTES = (
    "Each column: a fresh fleet (Ray Serve, one ingress) running that router, replaying the "
    "same trace over HTTP (streaming; TTFT at the client, to the first chunk carrying text). "
    "good: completed and met every objective it carries; goodput: those per second of the run "
    "(first arrival to last finish). completed / mean E2E: of the loosest tier. client − "
    "server TTFT: what the HTTP path, the proxy and the ingress add over the replica's own "
    "stamp. per replica: requests each replica answered (x-sloserve-replica), largest first. "
    "429s predicted past their SLO: the 429 body's predicted TTFT against the request's "
    "objective; 429s that missed when served: the same requests in the run where the same "
    "router served every request. accepted, late by more than a decode step: requests with a "
    "TTFT objective that were not refused and whose client TTFT missed it by more than the "
    "run's median TPOT (in reject mode, the target allows none for a routing decision); of "
    "those predicted in time where routed: the same among the requests whose predicted TTFT on "
    "the replica the router chose (x-sloserve-predicted-ttft-ms: its queue there and the "
    "forecast of what would overtake it) met the objective, the misses a routing decision "
    "caused rather than foresaw. /health samples with a stale replica "
    "report: the ingress's /health polled every 0.5 s during the replay, those naming a "
    "replica whose load report was older than the router's staleness limit (the router "
    "cannot predict on it then).\n")
