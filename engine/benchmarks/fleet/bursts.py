"""`fleet-bursts`: the trace family the fleet routers are compared on.

Urgent chat turns of 64-512 prompt tokens arrive in bursts among long documents:

- `urgent` (URGENT_SHARE of the requests): Uniform(64, 512) prompt tokens, 16 output tokens, a
  TTFT objective from 150 ms (64 tokens) to 300 ms (512 tokens), linear in the prompt's length.
  They come in bursts: a burst starts at Poisson times and holds BURST_SIZE turns (uniform),
  each BURST_GAP_S apart on average (exponential gaps), so that several turns land within
  ~100 ms on whatever replicas a router picks.
- `document`: Uniform(8192, 32768) prompt tokens (0.3-1.9 s of isolated prefill on an H100
  with an 8B model), 8 output tokens, a relaxed TTFT objective from 10 s (8k tokens) to 30 s
  (32k tokens). Poisson arrivals.

`rate` is the mean rate of all requests (urgent and documents), as for every built-in workload:
the documents arrive at (1 - URGENT_SHARE) * rate, the bursts at URGENT_SHARE * rate / mean
burst size. The SLOs are absolute (not a multiple of the calibrated line): they are what a chat
user asks of an H100-class GPU, so the trace means the same on every machine it is run on (it
is meant for simulated H100 replicas, `--simulate h100-llama-3.1-8b`). Prompt lengths are
clipped to `max_prompt_len`; the objectives follow the clipped lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.benchmarks.attainment.traces import (TierSpec, Tokenizer, Trace, TraceRequest,
                                                 Uniform, generate_trace)

# The load (where power-of-two meets at most 60% of the urgent objectives on 4
# replicas of h100-llama-3.1-8b), found by running `sloserve bench run --simulate
# h100-llama-3.1-8b --replicas 4 --workload fleet-bursts --seeds 0 --rates R --num-requests 30R
# --router pow2` (30 s of trace, seed 0) on the project's shared 2-core CPU machine (load
# average 7-11 from other work while it ran), pow2's urgent TTFT attainment:
#   8 req/s: 66%    10 req/s: 65%    11 req/s: 50%    12 req/s: 25%    14 req/s: 14%
# 11 req/s is the README's rate (2.75 documents/s over 4 replicas, ~70% of their prefill).
# Below 11 the misses hardly move with the load: ~40 ms of client-minus-server TTFT (Ray
# Serve's proxy, the ingress, the handle) and the engines' host time on the shared cores come
# on top of every turn's 30 ms step floor against 150-300 ms objectives; above 11 the machine,
# not only the simulated GPUs, saturates (client minus server TTFT 110 ms at 12 req/s). On a
# machine with a core per replica the curve would move right.
URGENT_SHARE = 0.75
URGENT_PROMPT = Uniform(64, 512)
DOCUMENT_PROMPT = Uniform(8192, 32768)
URGENT_OUTPUT_TOKENS = 16
DOCUMENT_OUTPUT_TOKENS = 8
BURST_SIZE = (4, 10)  # turns a burst holds, uniform, inclusive
BURST_GAP_S = 0.02  # mean gap between two turns of a burst


@dataclass(frozen=True)
class LinearSLO:
    """A TTFT objective linear in the prompt's length: `lo_ms` at `lo_tokens` or fewer,
    `hi_ms` at `hi_tokens` or more."""

    lo_tokens: int
    lo_ms: float
    hi_tokens: int
    hi_ms: float

    def __post_init__(self) -> None:
        if not (0 < self.lo_tokens < self.hi_tokens and 0 < self.lo_ms <= self.hi_ms):
            raise ValueError(f"LinearSLO: need 0 < lo_tokens < hi_tokens and "
                             f"0 < lo_ms <= hi_ms, got {self}")

    def slo_ms(self, prompt_len: int, predict_ttft_s: Callable[[int], float]) -> float | None:
        x = min(1.0, max(0.0, (prompt_len - self.lo_tokens) / (self.hi_tokens - self.lo_tokens)))
        return round(self.lo_ms + x * (self.hi_ms - self.lo_ms), 1)


URGENT_SLO = LinearSLO(64, 150.0, 512, 300.0)
DOCUMENT_SLO = LinearSLO(8192, 10_000.0, 32768, 30_000.0)


def fleet_bursts_tiers() -> list[TierSpec]:
    return [TierSpec("urgent", URGENT_SHARE, URGENT_PROMPT, URGENT_OUTPUT_TOKENS, URGENT_SLO),
            TierSpec("document", 1.0 - URGENT_SHARE, DOCUMENT_PROMPT, DOCUMENT_OUTPUT_TOKENS,
                     DOCUMENT_SLO)]


def burst_arrivals(num_urgent: int, num_documents: int, rate: float,
                   rng: np.random.Generator, burst_size: tuple[int, int] = BURST_SIZE,
                   burst_gap_s: float = BURST_GAP_S) -> tuple[list[float], list[float]]:
    """Arrival offsets of the urgent turns (in bursts of `burst_size` turns, uniform and
    inclusive, `burst_gap_s` apart on average) and of the documents (Poisson), at a mean total
    rate `rate`; each list sorted."""
    total = num_urgent + num_documents
    span = total / rate
    documents = np.sort(rng.uniform(0.0, span, num_documents)) if num_documents else []
    urgent: list[float] = []
    while len(urgent) < num_urgent:
        size = int(rng.integers(burst_size[0], burst_size[1] + 1))
        start = float(rng.uniform(0.0, span))
        at = start
        for _ in range(min(size, num_urgent - len(urgent))):
            urgent.append(at)
            at += float(rng.exponential(burst_gap_s))
    return sorted(urgent), [float(x) for x in documents]


def build_fleet_bursts(num_requests: int, rate: float, seed: int, tokenizer: Tokenizer,
                       predict_ttft_s: Callable[[int], float],
                       max_prompt_len: int | None = None) -> Trace:
    """The seeded `fleet-bursts` trace: prompts and objectives from the shared generator, the
    arrivals re-timed into bursts (the request ids follow the new order)."""
    return bursty_trace(fleet_bursts_tiers(), "fleet-bursts", num_requests, rate, seed,
                        tokenizer, predict_ttft_s, max_prompt_len=max_prompt_len)


def bursty_trace(tiers: list[TierSpec], workload: str, num_requests: int, rate: float,
                 seed: int, tokenizer: Tokenizer, predict_ttft_s: Callable[[int], float], *,
                 max_prompt_len: int | None = None, burst_size: tuple[int, int] = BURST_SIZE,
                 burst_gap_s: float = BURST_GAP_S) -> Trace:
    """A seeded trace of an `urgent` and a `document` tier: prompts and objectives from the
    shared generator, the urgent turns re-timed into bursts and the documents into Poisson
    arrivals (`burst_arrivals`; the request ids follow the new order)."""
    base = generate_trace(tiers, num_requests, rate, seed, tokenizer, predict_ttft_s,
                          workload=workload, max_prompt_len=max_prompt_len)
    by_tier: dict[str, list[TraceRequest]] = {"urgent": [], "document": []}
    for r in base.requests:
        by_tier[r.tier].append(r)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 34]))
    urgent_at, document_at = burst_arrivals(len(by_tier["urgent"]), len(by_tier["document"]),
                                            rate, rng, burst_size, burst_gap_s)
    timed = [(t, r) for t, r in zip(urgent_at, by_tier["urgent"])]
    timed += [(t, r) for t, r in zip(document_at, by_tier["document"])]
    timed.sort(key=lambda tr: tr[0])
    requests = [TraceRequest(request_id=f"{i:05d}-{r.tier}", tier=r.tier, arrival_s=t,
                             prompt_token_ids=r.prompt_token_ids, output_tokens=r.output_tokens,
                             ttft_slo_ms=r.ttft_slo_ms, tpot_slo_ms=r.tpot_slo_ms)
                for i, (t, r) in enumerate(timed)]
    meta = {**base.meta, "arrival": workload, "burstiness": None,
            "burst_size": list(burst_size), "burst_gap_s": burst_gap_s}
    return Trace(requests=requests, meta=meta)
