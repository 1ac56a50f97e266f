"""Urgent turns' whole streams at GPU time scales, in the GPU-timed simulation.

Long documents (16k-28k tokens, relaxed objectives) prefill one after another; short urgent
turns (64-512 tokens, a 150 ms TTFT objective, 32 output tokens) arrive at random moments
during them. Half of the turns' first tokens show nothing (a special token, a partial UTF-8
sequence, stop-string holdback): the consumer, as the API server does, reports a turn's first
*visible* output to the engine, and its TTFT is timed to that. Printed per budget:

- turns whose first visible output came within the objective, and the TTFT percentiles;
- the p99 gap between a turn's tokens, against the decode-only step of the profile;
- how late the late turns were (the worst, in steps of the profile's decode and in SLOs);
- the documents' mean completion time (what the turns cost them).

`--first-token-delivers` runs the same trace with the engine told nothing (the sampled token
counts as delivered, the old behaviour), side by side. `--bias 2` makes the
engine's TTFT predictor twice as pessimistic as the machine (every term doubled, online refits
included): mispredicted turns should still be served within about one step of their deadline.

    python -m bench.e2e.urgent_streams --budgets 2048 40000 --first-token-delivers
    python -m bench.e2e.urgent_streams --budgets 2048 40000 --bias 2
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.benchmarks.inputs.arrivals import submit_on_schedule
from engine.benchmarks.measure.figures import FigureLog
from engine.benchmarks.measure.stats import percentile

PROFILE = "h100-llama-3.1-8b"
SLO_MS = 150.0
DOC_SLO_MS = 30_000.0
TURN_OUTPUT = 32
DOC_OUTPUT = 4


@dataclass
class Turn:
    request: Any
    silent: bool
    token_times: list[float] = field(default_factory=list)

    @property
    def visible_at(self) -> float | None:
        index = 1 if self.silent else 0
        return self.token_times[index] if len(self.token_times) > index else None


class BiasedPredictor:
    """The engine's online TTFT predictor with every prediction scaled by `factor`: the
    model it fits is the machine's, what the scheduler and the monitor read is not."""

    def __init__(self, inner: Any, factor: float) -> None:
        self._inner, self._factor = inner, factor

    @property
    def current(self) -> Any:
        line, f = self._inner.current, self._factor
        scaled = {name: getattr(line, name) * f for name in (
            "seconds_per_token", "intercept_s", "seconds_per_token_sq",
            "seconds_per_decode_context", "floor_s")}
        for name in ("edge_seconds_per_token", "edge_seconds_per_token_sq",
                     "edge_seconds_per_decode_context"):
            if getattr(line, name, None) is not None:
                scaled[name] = getattr(line, name) * f
        return dataclasses.replace(line, **scaled)

    @current.setter
    def current(self, value: Any) -> None:
        self._inner.current = value

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _trace(seed: int, num_docs: int, num_turns: int, silent_share: float
           ) -> list[tuple[float, str, int, float, int, bool]]:
    """(offset s, id, prompt tokens, SLO ms, max tokens, silent first token), by offset."""
    rng = random.Random(seed)
    arrivals = []
    offset = 0.0
    for i in range(num_docs):
        tokens = rng.randrange(16_000, 28_001)
        arrivals.append((offset, f"doc{i}", tokens, DOC_SLO_MS, DOC_OUTPUT, False))
        offset += tokens * 4.5e-5  # a little faster than they prefill: a queue builds up
    for i in range(num_turns):
        arrivals.append((rng.uniform(0.2, offset), f"turn{i}", rng.randrange(64, 513), SLO_MS,
                         TURN_OUTPUT, rng.random() < silent_share))
    return sorted(arrivals)


def _sim_model(folder: Path) -> str:
    from engine.benchmarks.inputs.model_shapes import write_shape
    from engine.entrypoints.default_model import model_path_or_default

    return str(write_shape("llama-3.1-8b", folder, model_path_or_default(None)))


def run_once(model: str, budget: int, seed: int, num_docs: int, num_turns: int,
             silent_share: float, report_first_output: bool, bias: float) -> dict[str, Any]:
    from unittest import mock

    from engine.config import build_engine_config
    from engine.core.request import Request
    from engine.runtime import engine_core
    from engine.sampling_params import SamplingParams
    from monitor.predictor import StepTimePredictor

    config = build_engine_config(model, simulate=PROFILE, max_num_batched_tokens=budget,
                                 max_model_len=40_000, enable_prefix_caching=False)
    if bias == 1.0:
        engine = engine_core.EngineCore(config)
    else:
        # EngineCore builds its step-time predictor and hands that one object to every reader
        # (the scheduler, the monitor, the load report): built wrapped, they all read the
        # biased model, while the steps it is fed still refit the machine's underneath.
        def biased(*args: Any, **kwargs: Any) -> BiasedPredictor:
            return BiasedPredictor(StepTimePredictor(*args, **kwargs), bias)

        with mock.patch.object(engine_core, "StepTimePredictor", biased):
            engine = engine_core.EngineCore(config)
    rng = random.Random(seed + 1)
    turns: dict[str, Turn] = {}
    docs: dict[str, Any] = {}
    arrivals = []
    for offset, req_id, tokens, slo, max_tokens, silent in _trace(seed, num_docs, num_turns,
                                                                  silent_share):
        request = Request(request_id=req_id,
                          prompt_token_ids=[rng.randrange(5, 30_000) for _ in range(tokens)],
                          sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens,
                                                         ignore_eos=True),
                          ttft_slo_ms=slo, reports_first_output=report_first_output)
        arrivals.append((offset, request))
        if req_id.startswith("turn"):
            turns[req_id] = Turn(request, silent)
        else:
            docs[req_id] = request
    thread = submit_on_schedule(engine, arrivals)
    try:
        while thread.is_alive() or engine.has_unfinished_requests():
            if not engine.has_unfinished_requests():
                time.sleep(0.0005)
                continue
            now_outputs = engine.step()
            now = time.monotonic()
            for out in now_outputs:
                turn = turns.get(out.req_id)
                if turn is None or not out.new_token_ids:
                    continue
                turn.token_times.append(now)
                if report_first_output and len(turn.token_times) == (2 if turn.silent else 1):
                    engine.note_first_output(out.req_id, now)
        decode_step = engine.model.profile.step_seconds(1, 0, 600)
        stats = engine.stats()
    finally:
        engine.shutdown()
    ttfts = sorted(1000 * (t.visible_at - t.request.arrival_time) for t in turns.values()
                   if t.visible_at is not None)
    gaps = sorted(b - a for t in turns.values()
                  for a, b in zip(t.token_times, t.token_times[1:]))
    late = [x - SLO_MS for x in ttfts if x > SLO_MS]
    return {
        "budget": budget, "seed": seed, "bias": bias, "reported": report_first_output,
        "turns": len(turns), "met": sum(x <= SLO_MS for x in ttfts),
        "ttft_p50_ms": _pct(ttfts, 50), "ttft_p99_ms": _pct(ttfts, 99),
        "gap_p99_ms": 1000 * _pct(gaps, 99), "decode_step_ms": 1000 * decode_step,
        "worst_late_ms": max(late, default=0.0),
        "doc_mean_s": sum(d.finish_time - d.arrival_time for d in docs.values()) / len(docs),
        "slo_preemptions": stats.num_slo_preemptions}


def _pct(values: list[float], q: float) -> float:
    value = percentile(values, q)
    return float("nan") if value is None else value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[2048, 40_000])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--num-docs", type=int, default=6)
    p.add_argument("--num-turns", type=int, default=20)
    p.add_argument("--silent-share", type=float, default=0.5,
                   help="share of turns whose first token shows nothing")
    p.add_argument("--bias", type=float, default=1.0,
                   help="scale the engine's TTFT predictions (2: twice too pessimistic)")
    p.add_argument("--first-token-delivers", action="store_true",
                   help="also run with the engine told nothing: the sampled token counts as "
                        "delivered (the old behaviour)")
    p.add_argument("--output", type=Path, default=None, help="write the figures as .jsonl here")
    args = p.parse_args(argv)
    log = FigureLog(args.output)
    modes = [True, False] if args.first_token_delivers else [True]
    print(f"profile {PROFILE}: {args.num_docs} documents, {args.num_turns} turns "
          f"(SLO {SLO_MS:.0f} ms, {args.silent_share:.0%} with a silent first token), "
          f"predictor bias x{args.bias}")
    print(f"{'budget':>7} {'first output':>14} {'met':>7} {'ttft p50':>9} {'ttft p99':>9} "
          f"{'gap p99':>8} {'decode':>7} {'gap/dec':>7} {'worst late':>11} {'doc mean':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        model = _sim_model(Path(tmp) / "model")
        for budget in args.budgets:
            for seed in args.seeds:
                for reported in modes:
                    row = run_once(model, budget, seed, args.num_docs, args.num_turns,
                                   args.silent_share, reported, args.bias)
                    log.write("urgent_streams", **row)
                    print(f"{budget:>7} {'reported' if reported else 'sampled':>14} "
                          f"{row['met']:>3}/{row['turns']:<3} {row['ttft_p50_ms']:>7.0f}ms "
                          f"{row['ttft_p99_ms']:>7.0f}ms {row['gap_p99_ms']:>6.0f}ms "
                          f"{row['decode_step_ms']:>5.0f}ms "
                          f"{row['gap_p99_ms'] / row['decode_step_ms']:>7.2f} "
                          f"{row['worst_late_ms']:>9.0f}ms {row['doc_mean_s']:>8.2f}s", flush=True)
    log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
