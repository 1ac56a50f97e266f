"""Peers: other OpenAI-compatible servers (vLLM, SGLang, another sloserve) replayed the same
trace as sloserve, one after the other, and set side by side.

`sloserve bench run --runner http --url URL --peer vllm=URL2` replays each trace against the
sloserve server at URL (or a fresh `sloserve serve` per policy and budget, without --url), then
against each peer, never two at once (on a CPU they would share the cores). A peer gets exactly
the requests sloserve gets: the same arrivals, the same prompts as token ids (so it must serve
the same model, or one with the same tokenizer), the same output lengths (`ignore_eos`), and
each request's objectives as the body fields `ttft_slo_ms` / `tpot_slo_ms`, which a server that
does not schedule by deadline ignores. Its run is recorded under the peer's name as the policy
and budget 0 (its own settings, shown as "own").

`side_by_side` prints one table per trace with a column per server.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.benchmarks.attainment.policies import POLICIES, PolicySpec
from engine.benchmarks.attainment.results import (RunResult, format_met, format_number,
                                                  markdown_table, summarize)

# The budget a peer's run is recorded under: the peer runs its own settings.
PEER_BUDGET = 0

# A peer gets no tier priority (vLLM refuses a non-zero priority unless it runs its priority
# policy) and no settings of ours: this spec only gives run_http the defaults of fcfs.
PEER_POLICY = PolicySpec("peer", "fcfs")


@dataclass(frozen=True)
class Peer:
    name: str
    url: str
    model: str | None = None  # the name it serves the model under (None: ask /v1/models)


def parse_peers(specs: Sequence[str] | None, models: Sequence[str] | None = None) -> list[Peer]:
    """`--peer NAME=URL` values (and `--peer-model NAME=MODEL` ones) as peers; ValueError for
    a malformed one, a repeated name, or a name that is one of the policies'."""
    served: dict[str, str] = {}
    for spec in models or ():
        name, sep, model = spec.partition("=")
        if not sep or not name or not model:
            raise ValueError(f"--peer-model {spec!r}: expected NAME=MODEL")
        served[name] = model
    peers: list[Peer] = []
    for spec in specs or ():
        name, sep, url = spec.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.:+-]+", name) \
                or not re.match(r"https?://", url):
            raise ValueError(f"--peer {spec!r}: expected NAME=URL, e.g. "
                             f"vllm=http://127.0.0.1:8001")
        if name in POLICIES or name == "sloserve":
            raise ValueError(f"--peer {spec!r}: {name!r} names a sloserve policy; call the "
                             f"peer something else (vllm, sglang, ...)")
        if any(p.name == name for p in peers):
            raise ValueError(f"--peer: the name {name!r} is given twice")
        peers.append(Peer(name, url.rstrip("/"), served.pop(name, None)))
    if served:
        raise ValueError(f"--peer-model names no --peer: {', '.join(sorted(served))}")
    return peers


def _urgent(runs: Sequence[RunResult]) -> str | None:
    """The tier with the tightest median TTFT SLO over the runs (`urgent` in mixed and burst,
    `text` in flowprefill)."""
    best: tuple[float, str] | None = None
    for run in runs:
        for tier, s in summarize(run)["tiers"].items():
            slo = s.get("median_ttft_slo_ms")
            if slo is not None and (best is None or slo < best[0]):
                best = (slo, tier)
    return None if best is None else best[1]


def column_name(run: RunResult) -> str:
    """A server's column: the peer's name, or the sloserve policy (and its budget)."""
    if run.budget == PEER_BUDGET:
        return run.policy
    return f"sloserve {run.policy} @ {run.budget}"


def side_by_side(runs: Sequence[RunResult]) -> str:
    """One Markdown table per trace (workload, rate, seed): a row per figure, a column per
    server, in the order the runs were made."""
    traces: dict[tuple[str, float, int], list[RunResult]] = {}
    for run in runs:
        traces.setdefault((run.workload, run.rate, run.seed), []).append(run)
    parts = []
    for (workload, rate, seed), group in traces.items():
        urgent = _urgent(group)
        sums = [summarize(r) for r in group]
        tier = (lambda s: s["tiers"].get(urgent, {})) if urgent else (lambda s: {})
        rows: list[tuple[str, list[str]]] = [
            (f"{urgent or 'urgent'} TTFT attainment (met/total)",
             [format_met(tier(s).get("num_slo_met"), tier(s).get("num_slo_requests"))
              for s in sums]),
            ("TTFT attainment, all (met/total)",
             [format_met(s["num_slo_met"], s["num_slo_requests"]) for s in sums]),
        ]
        if any(s["num_tpot_slo_requests"] for s in sums):
            rows.append(("TPOT attainment (met/total)",
                         [format_met(s["num_tpot_slo_met"], s["num_tpot_slo_requests"])
                          for s in sums]))
        rows += [
            ("good (met every objective)", [format_met(s["num_good"], s["num_requests"])
                                            for s in sums]),
            ("goodput (req/s)", [format_number(s["request_goodput"], 3) for s in sums]),
            ("output throughput (tok/s)", [format_number(s["output_throughput"], 1) for s in sums]),
            ("total throughput (tok/s)", [format_number(s["total_token_throughput"], 0) for s in sums]),
            ("TTFT p50 / p90 / p99 (ms)",
             [" / ".join(format_number(s[k]) for k in ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms"))
              for s in sums]),
            (f"{urgent or 'urgent'} TTFT p50 / p99 (ms)",
             [" / ".join(format_number(tier(s).get(k)) for k in ("median_ttft_ms", "p99_ttft_ms"))
              for s in sums]),
            ("TPOT p50 / p99 (ms)",
             [" / ".join(format_number(s[k], 1) for k in ("median_tpot_ms", "p99_tpot_ms"))
              for s in sums]),
            ("failed", [str(s["failed"]) for s in sums]),
            ("requests the server counted", [_counted(r, "server_finished_requests")
                                             for r in group]),
            ("prefix-cache hits (tokens)", [_counted(r, "server_prefix_cache_hit_tokens")
                                            for r in group]),
        ]
        parts.append(markdown_table(
            f"{workload} at {rate:g} req/s, seed {seed}: the same trace, one server after "
            f"the other", ["", *(column_name(r) for r in group)], rows))
    return "\n".join(parts)


def _counted(run: RunResult, key: str) -> str:
    counted: Any = (run.engine or {}).get(key)
    return "–" if counted is None else str(counted)


PEER_NOTES = (
    "Each server replayed the same trace (arrivals, prompts as token ids, output lengths, "
    "objectives) on its own, one after the other; TTFT and TPOT are timed by the client at "
    "the first and later streamed chunks carrying text. The first tokens of every prompt were "
    "fresh salt (lengths unchanged, the same for every server), so no server found a prompt "
    "in its prefix cache. good: completed and met every objective it carries, as `vllm bench "
    "serve --goodput` counts them. requests the server counted, prefix-cache hits: its "
    "`*:request_success_total` and `*:prefix_cache_hits_total` counters over the run (the "
    "warm-up excluded).\n")
