"""`cpu-bursts`: urgent chat turns in bursts among long documents, with absolute objectives
sized for the default model (SmolLM2-135M) on a few CPU cores.

- `urgent` (URGENT_SHARE of the requests): Uniform(32, 160) prompt tokens, 16 output tokens, a
  TTFT objective from 250 ms (32 tokens) to 700 ms (160 tokens), linear in the prompt's length.
  They come in bursts of BURST_SIZE turns (uniform), BURST_GAP_S apart on average: two to four
  turns that land during one document's prefill.
- `document`: Uniform(2000, 5000) prompt tokens, 8 output tokens, a 30 s TTFT objective.
  Poisson arrivals.

`rate` is the mean rate of all requests, as for every built-in workload. The objectives are
absolute, not multiples of a calibrated line: what a chat user asks of this machine, so one
trace means the same on a quiet machine and on a busy one (`sloserve bench run --busy N`), and
a slower machine shows as misses rather than as laxer objectives. Prompt lengths are clipped to
`max_prompt_len` (a short-context model); the objectives follow the clipped lengths.

A document is most of the work: 3-12 s of isolated prefill each on bench/results/
ttft_model.json's line (2 cores; the attention term grows with the prompt's square; the first
2729-token document of seed 0 took 7.2 s here). At 0.5 req/s (a document every 8 s) the
documents alone keep the machine busy; the README runs 0.25 req/s (a document every 16 s).
Measured on a shared 2-core machine (bench/results/busy_cpu_bursts*/, 0.15 to 0.5 req/s), the
default server's quiet misses at 0.15 and 0.25 req/s were mostly the third to fifth turn of a
burst, about as many at either rate: the bursts, more than the rate, decide them.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.benchmarks.attainment.traces import (AbsoluteSLO, TierSpec, Tokenizer, Trace,
                                                 Uniform)
from engine.benchmarks.fleet.bursts import LinearSLO, bursty_trace

URGENT_SHARE = 0.75
URGENT_PROMPT = Uniform(32, 160)
URGENT_OUTPUT_TOKENS = 16
URGENT_SLO = LinearSLO(32, 250.0, 160, 700.0)
DOCUMENT_PROMPT = Uniform(2000, 5000)
DOCUMENT_OUTPUT_TOKENS = 8
DOCUMENT_SLO = AbsoluteSLO(30_000.0)
# Small bursts: a 160-token turn takes ~0.15 s to prefill here, so four at once already ask
# for most of the tightest objective.
BURST_SIZE = (2, 4)
BURST_GAP_S = 0.05


def cpu_bursts_tiers() -> list[TierSpec]:
    return [TierSpec("urgent", URGENT_SHARE, URGENT_PROMPT, URGENT_OUTPUT_TOKENS, URGENT_SLO),
            TierSpec("document", 1.0 - URGENT_SHARE, DOCUMENT_PROMPT, DOCUMENT_OUTPUT_TOKENS,
                     DOCUMENT_SLO)]


def build_cpu_bursts(num_requests: int, rate: float, seed: int, tokenizer: Tokenizer,
                     predict_ttft_s: Callable[[int], float],
                     max_prompt_len: int | None = None) -> Trace:
    """The seeded `cpu-bursts` trace (its arrivals are its own: --arrival and --burstiness do
    not apply)."""
    return bursty_trace(cpu_bursts_tiers(), "cpu-bursts", num_requests, rate, seed, tokenizer,
                        predict_ttft_s, max_prompt_len=max_prompt_len, burst_size=BURST_SIZE,
                        burst_gap_s=BURST_GAP_S)
