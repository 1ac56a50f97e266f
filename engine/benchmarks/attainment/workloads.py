"""Built-in benchmark workloads: named tier mixes turned into seeded traces.

- `mixed`: the project's headline workload. A minority of short interactive requests with tight
  deadlines shares the engine with long relaxed ones, which is exactly where FCFS suffers
  head-of-line blocking and slack-aware scheduling should help. Relaxed requests also carry a
  TPOT objective, so goodput (every objective met, as `vllm bench serve --goodput`) charges a
  scheduler for stalling streams to serve the urgent ones: a relaxed stream tolerates one
  512-token prefill chunk between two of its tokens, twice over, i.e. tpot_slo_ms =
  2 x predict_ttft_s(512) x 1000 (512 clipped to `max_prompt_len`). It follows the predictor like
  the TTFT SLOs, so it scales with the machine: at a 512-token budget a step costs about one
  chunk and leaves the stream room, while prefilling a whole long prompt in one step can stall
  it past the objective. Urgent requests have no TPOT objective: their 16 tokens are judged on
  TTFT.
- `flowprefill`: the four request classes of the FlowPrefill paper (text / image / search / file)
  with TTFT SLOs in its ratio 0.25 : 0.5 : 4 : 6, scaled to this machine.
- `uniform`: one tier of similar prompts and no SLOs, to check that the deadline machinery costs
  no throughput.
- `burst`: what mid-forward preemption exists for. Long documents whose prefill takes about
  BURST_DOCUMENT_S each (16k-32k tokens on an H100 with an 8B model, a few thousand on a CPU)
  share the engine with short interactive turns (64-256 tokens) whose deadline is a few of their
  own isolated TTFTs (150 ms on that H100): an urgent turn that waits out a document's step
  misses by a second. Use gamma arrivals with --burstiness > 1 for bursts.
- `deadline-burst`: the same shape with the objectives a CPU user would set: documents
  of about DEADLINE_BURST_DOCUMENT_S of isolated prefill each with relaxed objectives, and short
  turns (32-128 tokens) whose objective is three of their isolated TTFTs, at least 250 ms (on
  this CPU 250-450 ms). With gamma arrivals, turns land in bursts during documents' prefills.
- `fleet-bursts`: the fleet routers' trace (engine/benchmarks/fleet/bursts.py): urgent turns of
  64-512 tokens with 150-300 ms objectives in bursts among 8k-32k-token documents with 10-30 s
  ones; absolute objectives, for simulated H100 replicas. Its arrivals are its own (bursts):
  --arrival and --burstiness do not apply.
- `fleet-chat`: conversations (engine/benchmarks/fleet/chat.py): each follow-up turn resends a
  2k-8k-token history and adds 64-512 new tokens with fleet-bursts' 150-300 ms objectives, in
  bursts, among its documents; only a replica holding the history in its prefix cache meets
  them. A conversation's requests share one prefix salt over HTTP.
- `cpu-bursts`: the CPU's bursts (engine/benchmarks/attainment/cpu_bursts.py): urgent turns of
  32-160 tokens with 250-700 ms objectives in bursts of 2-4 among 2000-5000-token documents
  with a 30 s one; absolute objectives for the default model on a few CPU cores, so a trace
  means the same on a quiet machine and a busy one (`--busy`). Its arrivals are its own.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.benchmarks.attainment.traces import (AbsoluteSLO, Arrival, ChunkMultipleTPOT, Fixed,
                                                 IsolatedMultipleSLO, LengthDist, LogNormal, NoSLO,
                                                 TierSpec, Tokenizer, Trace, Uniform, dist_median,
                                                 generate_trace)

WORKLOADS: tuple[str, ...] = ("mixed", "flowprefill", "uniform", "burst", "deadline-burst",
                              "fleet-bursts", "fleet-chat", "cpu-bursts")

# Every built-in request generates this many tokens: the benchmark is mostly about TTFT, and a
# short decode keeps the engine's time dominated by the prefills that the schedulers compete over
# (16 tokens still give 15 gaps for a TPOT objective to judge).
OUTPUT_TOKENS = 16

# The relaxed tier's TPOT objective in `mixed` (see the module docstring).
MIXED_RELAXED_TPOT = ChunkMultipleTPOT(tokens=512, multiple=2.0)

# FlowPrefill's SLO ratio between its classes, and how tight the tightest one is: the text
# class's SLO is this many times its isolated TTFT, and the other classes keep the ratio.
FLOWPREFILL_SLO_RATIO: dict[str, float] = {"text": 0.25, "image": 0.5, "search": 4.0, "file": 6.0}
FLOWPREFILL_TEXT_MULTIPLE = 3.0


def _clip(dist: LengthDist, max_len: int | None) -> int:
    """The representative length of `dist` once prompts are clipped to `max_len`."""
    n = dist_median(dist)
    return n if max_len is None else min(n, max_len)


def mixed_tiers() -> list[TierSpec]:
    # sigma 0.6 puts about 4% of relaxed prompts on the 512 floor and 1% on the 6000 cap, so the
    # clip bounds the tail without turning the distribution into two spikes.
    return [
        TierSpec("urgent", 0.2, Uniform(64, 256), OUTPUT_TOKENS,
                 IsolatedMultipleSLO(multiple=3.0, floor_ms=250.0)),
        TierSpec("relaxed", 0.8, LogNormal(median=1500, sigma=0.6, lo=512, hi=6000),
                 OUTPUT_TOKENS, IsolatedMultipleSLO(multiple=10.0), MIXED_RELAXED_TPOT),
    ]


def flowprefill_tiers(predict_ttft_s: Callable[[int], float],
                      max_prompt_len: int | None = None) -> list[TierSpec]:
    # Prompt lengths and shares are our choice (the classes are named after what fills the
    # prompt), sized for an 8k-context model:
    #   text   40%  short chat turns, lognormal median 192 (32-512)
    #   image  30%  a block of image-patch tokens plus a question: uniform 600-1000
    #   search 20%  retrieved passages stuffed into the context, lognormal median 2500 (1500-4500)
    #   file   10%  a whole uploaded document, lognormal median 5000 (3500-7000)
    # Interactive classes dominate the count, long ones dominate the tokens (about 75%).
    lengths: dict[str, tuple[float, LengthDist]] = {
        "text": (0.4, LogNormal(median=192, sigma=0.5, lo=32, hi=512)),
        "image": (0.3, Uniform(600, 1000)),
        "search": (0.2, LogNormal(median=2500, sigma=0.3, lo=1500, hi=4500)),
        "file": (0.1, LogNormal(median=5000, sigma=0.2, lo=3500, hi=7000)),
    }
    # One scale for all four classes, fixed by the text class's median prompt, so every SLO is
    # absolute and the 0.25 : 0.5 : 4 : 6 ratio holds exactly, request by request.
    text_ref = _clip(lengths["text"][1], max_prompt_len)
    text_slo_ms = FLOWPREFILL_TEXT_MULTIPLE * predict_ttft_s(text_ref) * 1000.0
    scale_ms = text_slo_ms / FLOWPREFILL_SLO_RATIO["text"]
    return [TierSpec(name, share, dist, OUTPUT_TOKENS,
                     AbsoluteSLO(FLOWPREFILL_SLO_RATIO[name] * scale_ms))
            for name, (share, dist) in lengths.items()]


def uniform_tiers() -> list[TierSpec]:
    # Prompts of about 512 tokens (all above the monitor's 128-token preemptible-step threshold,
    # so its checks run) and a longer decode, so total tokens/s covers both phases.
    return [TierSpec("uniform", 1.0, Uniform(480, 544), 32, NoSLO())]


# `burst`: a document's isolated prefill (the 24k-token step of an 8B model on an H100), its
# share of the requests, and the urgent turns' SLO as a multiple of their longest prompt's
# isolated TTFT (4 x 38 ms = 150 ms on that H100).
BURST_DOCUMENT_S = 1.2
BURST_DOCUMENT_SHARE = 0.3
BURST_URGENT_MULTIPLE = 4.0
BURST_URGENT_PROMPT = Uniform(64, 256)


def burst_tiers(predict_ttft_s: Callable[[int], float],
                max_prompt_len: int | None = None) -> list[TierSpec]:
    document = _tokens_within(predict_ttft_s, BURST_DOCUMENT_S, max_prompt_len)
    urgent_slo_ms = (BURST_URGENT_MULTIPLE * 1000.0
                     * predict_ttft_s(_clip(Fixed(BURST_URGENT_PROMPT.hi), max_prompt_len)))
    return [
        TierSpec("urgent", 1.0 - BURST_DOCUMENT_SHARE, BURST_URGENT_PROMPT, OUTPUT_TOKENS,
                 AbsoluteSLO(urgent_slo_ms)),
        TierSpec("document", BURST_DOCUMENT_SHARE,
                 Uniform(max(1, document * 2 // 3), max(1, document * 4 // 3)), OUTPUT_TOKENS,
                 IsolatedMultipleSLO(multiple=10.0)),
    ]


# `deadline-burst`: a document's isolated prefill on the machine, and the turns' objectives.
DEADLINE_BURST_DOCUMENT_S = 2.0
DEADLINE_BURST_TURN = Uniform(32, 128)
DEADLINE_BURST_TURN_SLO = IsolatedMultipleSLO(multiple=3.0, floor_ms=250.0)


def deadline_burst_tiers(predict_ttft_s: Callable[[int], float],
                         max_prompt_len: int | None = None) -> list[TierSpec]:
    document = _tokens_within(predict_ttft_s, DEADLINE_BURST_DOCUMENT_S, max_prompt_len)
    return [
        TierSpec("urgent", 1.0 - BURST_DOCUMENT_SHARE, DEADLINE_BURST_TURN, OUTPUT_TOKENS,
                 DEADLINE_BURST_TURN_SLO),
        TierSpec("document", BURST_DOCUMENT_SHARE,
                 Uniform(max(1, document * 2 // 3), max(1, document * 4 // 3)), OUTPUT_TOKENS,
                 IsolatedMultipleSLO(multiple=10.0)),
    ]


def _tokens_within(predict_ttft_s: Callable[[int], float], seconds: float,
                   max_prompt_len: int | None) -> int:
    """The longest prompt whose isolated TTFT is within `seconds` (bisection: the predictor is
    increasing in the prompt length), a third under `max_prompt_len` so that the documents'
    spread (2/3 to 4/3 of it) fits the context."""
    hi = (max_prompt_len * 3 // 4) if max_prompt_len is not None else 1 << 20
    lo = 1
    if predict_ttft_s(hi) <= seconds:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if predict_ttft_s(mid) <= seconds else (lo, mid)
    return lo


def workload_tiers(name: str, predict_ttft_s: Callable[[int], float],
                   max_prompt_len: int | None = None) -> list[TierSpec]:
    if name == "mixed":
        return mixed_tiers()
    if name == "flowprefill":
        return flowprefill_tiers(predict_ttft_s, max_prompt_len)
    if name == "uniform":
        return uniform_tiers()
    if name == "burst":
        return burst_tiers(predict_ttft_s, max_prompt_len)
    if name == "deadline-burst":
        return deadline_burst_tiers(predict_ttft_s, max_prompt_len)
    if name == "fleet-bursts":
        from engine.benchmarks.fleet.bursts import fleet_bursts_tiers

        return fleet_bursts_tiers()
    if name == "fleet-chat":
        from engine.benchmarks.fleet.chat import fleet_chat_tiers

        return fleet_chat_tiers()
    if name == "cpu-bursts":
        from engine.benchmarks.attainment.cpu_bursts import cpu_bursts_tiers

        return cpu_bursts_tiers()
    raise ValueError(f"unknown workload {name!r}; built-ins: {', '.join(WORKLOADS)}")


def build_workload(name: str, num_requests: int, rate: float, seed: int, tokenizer: Tokenizer,
                   predict_ttft_s: Callable[[int], float], *, arrival: Arrival = "poisson",
                   burstiness: float = 1.0, max_prompt_len: int | None = None) -> Trace:
    """The seeded trace of built-in workload `name`. `max_prompt_len` clips prompt lengths for a
    model with a short context (pass max_model_len minus the output tokens); the SLOs follow the
    clipped lengths."""
    if name == "fleet-bursts":
        from engine.benchmarks.fleet.bursts import build_fleet_bursts

        return build_fleet_bursts(num_requests, rate, seed, tokenizer, predict_ttft_s,
                                  max_prompt_len=max_prompt_len)
    if name == "fleet-chat":
        from engine.benchmarks.fleet.chat import build_fleet_chat

        return build_fleet_chat(num_requests, rate, seed, tokenizer, predict_ttft_s,
                                max_prompt_len=max_prompt_len)
    if name == "cpu-bursts":
        from engine.benchmarks.attainment.cpu_bursts import build_cpu_bursts

        return build_cpu_bursts(num_requests, rate, seed, tokenizer, predict_ttft_s,
                                max_prompt_len=max_prompt_len)
    tiers = workload_tiers(name, predict_ttft_s, max_prompt_len)
    return generate_trace(tiers, num_requests, rate, seed, tokenizer, predict_ttft_s,
                          arrival=arrival, burstiness=burstiness, workload=name,
                          max_prompt_len=max_prompt_len)


__all__ = ["MIXED_RELAXED_TPOT", "WORKLOADS", "build_workload", "burst_tiers",
           "deadline_burst_tiers", "flowprefill_tiers", "mixed_tiers", "uniform_tiers",
           "workload_tiers"]
