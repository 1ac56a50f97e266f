"""The flood's figures: what the client counted, what the server counted, and whether they agree.

The server's refusals are read from its /metrics before and after the flood (the difference is
the flood's): one server counts each 429 by reason in `vllm:admission_rejections_total` and
`sloserve:num_requests_rejected_total` (max_num_queued_reqs, max_num_queued_tokens, doomed); a
fleet's ingress counts its 429s in `sloserve:fleet_rejected_total` by the same reasons (the
doomed ones it refused, and a queue bound's refusal that no other replica could take instead).
Each counter the server exports must equal the client's 429s of the reasons it counts.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from engine.benchmarks.flood.client import (DOOMED, OTHER_429, QUEUED_REQS, QUEUED_TOKENS,
                                            RELAXED, URGENT, Record)
from engine.benchmarks.measure.stats import percentile

REASONS = (QUEUED_REQS, QUEUED_TOKENS, DOOMED)
# The server's rejection counters, each counted by its `reason` label.
REJECTION_COUNTERS = ("vllm:admission_rejections_total", "sloserve:num_requests_rejected_total",
                      "sloserve:fleet_rejected_total")


# A fleet's requests that a replica refused at its queue bound and another then took.
REROUTED_COUNTER = "sloserve:fleet_rerouted_total"


def rejection_counters(metrics_text: str,
                       names: Sequence[str] = REJECTION_COUNTERS) -> dict[str, dict[str, float]]:
    """Each of the counters `names` the server exports, by reason; a counter it does not export
    is absent."""
    out: dict[str, dict[str, float]] = {}
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):  # exported, though maybe no reason counted yet
            # prometheus_client names a counter without `_total` here once it has samples,
            # with it while a labelled one has none.
            name = line.split()[2]
            name = name if name.endswith("_total") else name + "_total"
            if name in names:
                out.setdefault(name, {})
            continue
        for name in names:
            if not re.match(rf"{re.escape(name)}[{{ ]", line):
                continue
            value = float(line.rsplit(" ", 1)[1])
            match = re.search(r'reason="([^"]*)"', line)
            reason = match.group(1) if match else "?"
            counts = out.setdefault(name, {})
            counts[reason] = counts.get(reason, 0.0) + value
    return out


def counter_deltas(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
                   ) -> dict[str, dict[str, int]]:
    return {name: {reason: int(round(value - before.get(name, {}).get(reason, 0.0)))
                   for reason, value in sorted(counts.items())}
            for name, counts in after.items()}


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def outside_server_ms(record: Record, time_scale: float = 1.0) -> tuple[float, float] | None:
    """Of an accepted request's TTFT by the client's clock, what the server's own clocks do not
    hold (ms, in the profile's time): from the client's send to the server's arrival stamp
    (the client's sending, the network, the server reading the request), and from its first
    token to the client (the way back). Needs the client and the server on one host's wall
    clock; None without the stamps."""
    metrics = record.server_metrics or {}
    arrival = metrics.get("arrival_time")
    if (record.sent_at is None or not isinstance(arrival, (int, float))
            or record.ttft_ms is None or record.server_ttft_ms is None):
        return None
    before = 1e3 * (arrival - record.sent_at) / time_scale
    return before, record.ttft_ms - record.server_ttft_ms - before


def _kind_summary(records: Sequence[Record], kind: str, time_scale: float,
                  same_host: bool) -> dict[str, Any]:
    mine = [r for r in records if r.kind == kind]
    accepted = [r for r in mine if r.status == 200]
    outside = [split for r in accepted
               if (split := outside_server_ms(r, time_scale)) is not None] if same_host else []
    ttft = [r.ttft_ms for r in accepted if r.ttft_ms is not None]
    ttfb = [r.ttfb_ms for r in accepted if r.ttfb_ms is not None]
    server = [r.server_ttft_ms for r in accepted if r.server_ttft_ms is not None]
    slos = [r.ttft_slo_ms for r in mine]
    return {"sent": len(mine), "accepted": len(accepted),
            "completed": sum(r.completed for r in accepted),
            "met": sum(r.met for r in accepted),
            "rejected": sum(r.status == 429 for r in mine),
            "ttft_slo_ms": [min(slos), max(slos)] if slos else None,
            "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
            "ttft_max_ms": _ms(max(ttft)) if ttft else None,
            "ttfb_p50_ms": _ms(percentile(ttfb, 50)),
            "server_ttft_p50_ms": _ms(percentile(server, 50)),
            "before_server_stamp_p50_ms": _ms(percentile([b for b, _ in outside], 50)),
            # Of that, the client's own writing (its one process writes every request).
            "written_p50_ms": _ms(percentile([r.written_ms for r in accepted
                                              if r.written_ms is not None], 50)),
            "after_server_first_token_p50_ms": _ms(percentile([a for _, a in outside], 50)),
            "missed": [{"index": r.index, "ttft_ms": r.ttft_ms, "ttft_slo_ms": r.ttft_slo_ms,
                        "server_ttft_ms": r.server_ttft_ms}
                       for r in accepted if not r.met]}


def summarize(records: Sequence[Record], counters: dict[str, dict[str, int]],
              fleet: bool, elapsed_s: float, time_scale: float = 1.0,
              health: dict[str, Any] | None = None,
              rerouted: dict[str, int] | None = None, same_host: bool = False
              ) -> dict[str, Any]:
    """The flood's figures, the counters' agreement with the client and the verdict. `health`:
    a fleet's /health sampled during the flood (fleet_run.HealthSampler's summary); `rerouted`:
    its requests refused at a replica's queue bound and tried on another, by reason;
    `same_host`: the client and the server read one wall clock (their TTFTs' difference is
    then split into before the server's stamp and after its first token)."""
    status = Counter(r.status for r in records)
    rejected = Counter(r.reject_reason for r in records if r.status == 429)
    accepted = [r for r in records if r.status == 200]
    incomplete = [r for r in accepted if not r.completed]
    server_errors = [r for r in records if r.status is not None and r.status >= 500]
    other = [r for r in records if r.status not in (200, 429) and r not in server_errors]
    agreement = {}
    for name, counts in counters.items():
        reasons = REASONS
        client = {reason: rejected.get(reason, 0) for reason in reasons}
        server = {reason: counts.get(reason, 0) for reason in reasons}
        extra = {reason: n for reason, n in counts.items() if reason not in reasons and n}
        agreement[name] = {"client": client, "server": {**server, **extra},
                           "agree": client == server and not extra}
    # The 429s no exported counter counts (none, while the server counts every reason).
    counted = set(REASONS) if counters else set()
    uncounted = {reason: n for reason, n in rejected.items() if reason not in counted and n}
    failures = [text for bad, text in (
        (server_errors, f"{len(server_errors)} responses with a 5xx status"),
        (incomplete, f"{len(incomplete)} accepted requests did not complete"),
        (other, f"{len(other)} answers neither 200 nor 429 (nor 5xx)"),
        (rejected.get(OTHER_429), f"{rejected.get(OTHER_429)} 429s naming no known bound"),
        (not counters, "the server exports no rejection counter"),
        (any(not a["agree"] for a in agreement.values()),
         "the server's rejection counters disagree with the client's 429s"),
    ) if bad]
    retry_after = Counter(r.retry_after for r in records if r.status == 429)
    predicted = [r.predicted_ttft_ms for r in records if r.predicted_ttft_ms is not None]
    return {
        "sent": len(records),
        "elapsed_s": round(elapsed_s, 2),
        "ok_200_completed": len(accepted) - len(incomplete),
        "ok_200_incomplete": len(incomplete),
        "rejected_429": sum(rejected.values()),
        "rejected_429_by_reason": {reason: rejected.get(reason, 0)
                                   for reason in (*REASONS, OTHER_429)},
        "status_5xx": len(server_errors),
        "status_other": len(other),
        "statuses": {str(k): v for k, v in sorted(status.items(), key=lambda kv: str(kv[0]))},
        "urgent": _kind_summary(records, URGENT, time_scale, same_host),
        "relaxed": _kind_summary(records, RELAXED, time_scale, same_host),
        "retry_after": dict(retry_after.most_common()),
        "doomed_predicted_ttft_ms": {"n": len(predicted), "min": _ms(min(predicted)),
                                     "max": _ms(max(predicted))} if predicted else None,
        "server_counters": counters,
        "counters_agree": agreement,
        "uncounted_429s": uncounted,
        "rerouted": rerouted,
        "replicas": dict(Counter(r.replica for r in accepted if r.replica).most_common())
        if fleet else None,
        "fleet_health": health,
        "time_scale": time_scale,
        "failures": failures,
        "ok": not failures,
    }


def _kind_row(s: dict[str, Any]) -> str:
    if not s["sent"]:
        return "none sent"
    text = (f"{s['accepted']} of {s['sent']}; met objective {s['met']}/{s['accepted']}")
    if s["ttft_p50_ms"] is not None:
        text += (f"; TTFT p50 {s['ttft_p50_ms']:.0f} ms, p99 {s['ttft_p99_ms']:.0f} ms, "
                 f"max {s['ttft_max_ms']:.0f} ms (first byte p50 {s['ttfb_p50_ms']:.0f} ms")
        if s["server_ttft_p50_ms"] is not None:
            text += f", server's own TTFT p50 {s['server_ttft_p50_ms']:.0f} ms"
        text += ")"
    lo, hi = s["ttft_slo_ms"]
    text += f"; objectives {lo:g}-{hi:g} ms" if lo != hi else f"; objective {lo:g} ms"
    return text


def table(summary: dict[str, Any], title: str) -> str:
    """The printed figures: one `name  value` row each."""
    s = summary
    by = s["rejected_429_by_reason"]
    rows: list[tuple[str, Any]] = [
        ("sent", s["sent"]),
        ("200 completed", s["ok_200_completed"]),
        ("200 incomplete", s["ok_200_incomplete"]),
        ("429 queue bound", by[QUEUED_REQS] + by[QUEUED_TOKENS]),
        ("429 doomed", by[DOOMED]),
        ("429 other", by[OTHER_429]),
        ("5xx", s["status_5xx"]),
        ("other", s["status_other"]),
        ("urgent accepted", _kind_row(s["urgent"])),
        ("relaxed accepted", _kind_row(s["relaxed"])),
    ]
    u = s["urgent"]
    if u.get("before_server_stamp_p50_ms") is not None:
        # Where the client's TTFT and the server's part: the rest is the server's own.
        written = ("" if u.get("written_p50_ms") is None else
                   f" (the client had written it at p50 {u['written_p50_ms']:.0f} ms)")
        rows.append(("urgent outside the server",
                     f"p50 {u['before_server_stamp_p50_ms']:.0f} ms from the client's send to "
                     f"the server's arrival stamp{written}, "
                     f"{u['after_server_first_token_p50_ms']:.0f} ms from its first token to "
                     f"the client"))
    if by[QUEUED_TOKENS]:  # the queue bound's 429s that --max-num-queued-tokens refused
        rows.insert(4, ("429 queued tokens", by[QUEUED_TOKENS]))
    for name, a in s["counters_agree"].items():
        server = ", ".join(f"{reason} {n}" for reason, n in a["server"].items())
        client = ", ".join(f"{reason} {n}" for reason, n in a["client"].items())
        rows.append((name, f"{server} (client: {client}) "
                           f"{'agree' if a['agree'] else 'DISAGREE'}"))
    if s["uncounted_429s"]:
        rows.append(("429s not counted here",
                     ", ".join(f"{reason} {n}" for reason, n in s["uncounted_429s"].items())))
    if s.get("rerouted") is not None:
        rows.append(("tried on another replica", ", ".join(
            f"{reason} {n}" for reason, n in s["rerouted"].items() if n) or "0"))
    if s["retry_after"]:
        # Whole seconds as the server sent them: a slowed run's are in its own (slowed) clock.
        label = "Retry-After (429s)" if s["time_scale"] == 1.0 else "Retry-After (as sent)"
        rows.append((label, ", ".join(
            f"{value} s x{n}" if value is not None else f"none x{n}"
            for value, n in s["retry_after"].items())))
    if s["doomed_predicted_ttft_ms"]:
        d = s["doomed_predicted_ttft_ms"]
        rows.append(("doomed predicted_ttft_ms", f"{d['min']:.0f}-{d['max']:.0f} ms ({d['n']})"))
    if s["replicas"] is not None:
        rows.append(("accepted per replica", " / ".join(map(str, s["replicas"].values()))
                     or "-"))
    if s["fleet_health"]:
        h = s["fleet_health"]
        rows.append(("/health with a stale report", f"{h['samples_with_stale_report']} of "
                                                     f"{h['samples']} samples"))
    rows.append(("flood took", f"{s['elapsed_s']:.2f} s"))
    rows.append(("result", "OK" if s["ok"] else "FAIL: " + "; ".join(s["failures"])))
    width = max(len(name) for name, _ in rows)
    return "\n".join([title, *(f"{name:<{width}}  {value}" for name, value in rows)])
