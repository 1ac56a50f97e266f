"""`sloserve bench latency`, preemption latency: how long after an urgent request arrives the running long prefill is
unwound, against the time of one layer of that prefill (docs/design.md section 4; target: p99 under
one layer time plus 5 ms).

Each trial runs a long prefill (one step, `--prompt-tokens`) and submits an urgent request from
another thread at a random point in the first 80% of the step's layers, as the HTTP reader
thread would. The unwind time is when EngineCore holds the PREEMPTED step. The layer time is
measured in the same run, from unpreempted runs of the same long step interleaved with the
trials (the machine is shared and noisy). Prints figures as `key: value` lines.

The unwind is the host's; what the urgent request's client sees is its first token, which on a
GPU also waits for the layers already queued when the step was stopped (the run-ahead window,
workers/preemption/run_ahead.py). So after each unwind the engine steps on until the urgent
request has its first token: `arrival_to_first_token_ms`, and how many trials got it within the
urgent SLO. Those follow-up steps are left out of the graph counters below.

`--prompt-tokens` takes several sizes (`--prompt-tokens 16384 512`), measured one after the
other on one engine. With CUDA graphs, a step of up to 512 prefill tokens replays one captured
piece per layer boundary with the vote eager between pieces (workers/graphs/piecewise_graphs.py) and a
larger one runs eager, so a small size measures the unwind between pieces. Each size's block
starts with its `layers: ..., prompt_tokens: N, ...` line and says how its long steps ran
(`long_step_ran_as: pieces|eager|mixed`, from the runner's counters; `unknown` without an
in-process runner, as in --simulate) and how many replayed steps a vote stopped between two
pieces (`unwinds_between_pieces`).

The urgent request's SLO is scaled to the measured steps (unless `--urgent-slo-ms` fixes it):
its own isolated TTFT plus a tenth of the long step, so that its slack never covers the rest of
the step (at least 20% of it is left at the latest arrival point) and the monitor's necessity
test must stop the step. A fixed SLO that outlasts the step (2 s against an 8B model's 749 ms
step on a GPU) rightly makes the monitor wait, and measures nothing.

`--output PATH` writes {"model", "device", "layers", "threads", "urgent_ttft_alone_ms", "sizes": [one
object per size, in the order given: its figures and every trial's times]} at the end. As they
are measured, its .jsonl twin (`preempt_latency.json` -> `preempt_latency.jsonl`,
engine/benchmarks/measure/figures.py) gets one JSON line each: `run` (model, device, layers, threads),
`urgent_alone`
(urgent_ttft_alone_ms), a `trial` per trial (prompt_tokens, trial, clean long step ms, the SLO,
and the unwind's times or `unwound: false`), a `size` per size (the figures the JSON's "sizes"
holds) and `done`; a run killed at a time limit keeps every trial it finished.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.benchmarks.measure.figures import FigureLog, jsonl_twin
from engine.benchmarks.measure.stats import percentile
from engine.benchmarks.standalone import standalone_main

from engine.config import build_engine_config
from engine.runtime.engine_core import EngineCore
from engine.core.request import Request
from engine.runtime.slo_preemption import SLOPreemptionEvent
from engine.sampling_params import SamplingParams
from engine.simulation import load_profile

# An SLO no step here comes near: the request is never urgent.
RELAXED_SLO_MS = 600_000


def _request(req_id: str, prompt: list[int], slo_ms: float) -> Request:
    return Request(request_id=req_id, prompt_token_ids=prompt, ttft_slo_ms=slo_ms,
                   sampling_params=SamplingParams(max_tokens=1, temperature=0.0))


def _drain(engine: EngineCore) -> None:
    while engine.has_unfinished_requests():
        engine.step()


@dataclass(frozen=True)
class GraphCounters:
    """The in-process runner's graph counters at one moment (workers/graphs/piecewise_graphs.py,
    workers/graphs/cuda_graphs.py); all zero where graphs are off (CPU, --enforce-eager)."""
    piece_replays: int  # steps replayed as pieces to the end
    piece_unwinds: int  # replayed steps a vote stopped between two pieces
    decode_replays: int  # decode-only steps replayed as one graph

    def __sub__(self, earlier: GraphCounters) -> GraphCounters:
        return GraphCounters(self.piece_replays - earlier.piece_replays,
                             self.piece_unwinds - earlier.piece_unwinds,
                             self.decode_replays - earlier.decode_replays)

    def __add__(self, other: GraphCounters) -> GraphCounters:
        return GraphCounters(self.piece_replays + other.piece_replays,
                             self.piece_unwinds + other.piece_unwinds,
                             self.decode_replays + other.decode_replays)


def graph_counters(engine: EngineCore) -> GraphCounters | None:
    """None where the model runner is not in this process (--simulate, tensor parallel)."""
    runner = getattr(getattr(engine, "executor", None), "runner", None)
    if runner is None:
        return None
    piecewise = getattr(runner, "piecewise", None)
    decode = getattr(runner, "graphs", None)
    return GraphCounters(piece_replays=piecewise.replays if piecewise is not None else 0,
                         piece_unwinds=piecewise.unwinds if piecewise is not None else 0,
                         decode_replays=decode.replays if decode is not None else 0)


def ran_as(pieces: int, steps: int) -> str:
    """How `steps` long steps ran, `pieces` of them replayed as pieces."""
    if pieces == 0:
        return "eager"
    return "pieces" if pieces == steps else "mixed"


class LatencyBench:
    """One engine, measured at one prompt size after another; each trial and size handed to
    `record(kind, **fields)` as it ends (a FigureLog's write)."""

    def __init__(self, engine: EngineCore, seed: int, urgent_slo_ms: float | None,
                 record: Callable[..., None] = FigureLog(None).write) -> None:
        assert engine.slo_preemption is not None, "the engine must run the SLO monitor"
        self.engine = engine
        self.record = record
        self.num_layers: int = engine.model.hf_config.num_hidden_layers
        self.urgent_slo_ms = urgent_slo_ms
        self.rng = random.Random(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.short_s = 0.0
        # Graph replays of the steps that serve an urgent request after an unwind, kept out of
        # the long steps' counters.
        self.follow_up_counters = GraphCounters(0, 0, 0)
        self.warmed: set[int] = set()

    def prompt(self, n: int) -> list[int]:
        return torch.randint(100, self.engine.vocab_size, (n,), generator=self.generator).tolist()

    def warm_up(self, prompt_tokens: int) -> None:
        """One unmeasured long step of this size (the first step of a shape pays one-off
        costs), once per size."""
        if prompt_tokens in self.warmed:
            return
        self.warmed.add(prompt_tokens)
        self.engine.add_request(_request(f"warmup-{prompt_tokens}t", self.prompt(prompt_tokens),
                                         RELAXED_SLO_MS))
        _drain(self.engine)

    def measure_urgent_alone(self) -> float:
        """The urgent request's own TTFT (a 16-token prompt on an idle engine), in seconds."""
        short_steps: list[float] = []
        for i in range(5):
            self.engine.add_request(_request(f"short{i}", self.prompt(16), RELAXED_SLO_MS))
            started = time.monotonic()
            _drain(self.engine)
            short_steps.append(time.monotonic() - started)
        self.short_s = statistics.median(short_steps)
        return self.short_s

    def measure_size(self, prompt_tokens: int, trials: int) -> dict[str, Any]:
        """`trials` clean long steps interleaved with `trials` preempted ones; the figures."""
        engine = self.engine
        tag = f"{prompt_tokens}t"
        self.warm_up(prompt_tokens)
        counters_before = graph_counters(engine)
        step_times: list[float] = []
        events: list[tuple[Request, SLOPreemptionEvent]] = []
        first_tokens_ms: list[float] = []
        self.follow_up_counters = GraphCounters(0, 0, 0)
        missed = 0
        slo_ms = 0.0
        for trial in range(trials):
            # An unpreempted run of the long step, interleaved with the trials.
            step_times.append(self._clean_step(f"clean{trial}-{tag}", prompt_tokens))
            median_step_s = statistics.median(step_times)
            slo_ms = self.urgent_slo_ms or 1000 * (self.short_s + 0.1 * median_step_s)
            long = _request(f"long{trial}-{tag}", self.prompt(prompt_tokens), RELAXED_SLO_MS)
            urgent = _request(f"urgent{trial}-{tag}", self.prompt(16), slo_ms)
            event = self._preempted_step(long, urgent,
                                         delay_s=self.rng.uniform(0.0, 0.8) * median_step_s)
            if event is None:
                missed += 1  # arrived too late for the Rule 2 window (or not at all)
            else:
                events.append((urgent, event))
                first_tokens_ms.append(_first_token_ms(urgent))
            self.record("trial", prompt_tokens=prompt_tokens, trial=trial,
                        long_step_ms=step_times[-1] * 1000, urgent_slo_ms=slo_ms,
                        unwound=event is not None, **({} if event is None else {
                            "arrival_to_unwind_ms": (event.unwound_at - urgent.arrival_time)
                            * 1000,
                            "arrival_to_first_token_ms": first_tokens_ms[-1],
                            "arrival_to_decision_ms": (event.decided_at - urgent.arrival_time)
                            * 1000,
                            "decision_to_unwind_ms": (event.unwound_at - event.decided_at)
                            * 1000}))
        counters_after = graph_counters(engine)
        if counters_after is not None:
            counters_after = counters_after - self.follow_up_counters
        figures = {
            "prompt_tokens": prompt_tokens, "trials": trials,
            "unwound": len(events), "not_unwound": missed,
            "layer_ms": statistics.median(step_times) / self.num_layers * 1000,
            "urgent_slo_ms": slo_ms,
            "long_step_ms": [t * 1000 for t in step_times],
            "arrival_to_unwind_ms": [(e.unwound_at - u.arrival_time) * 1000 for u, e in events],
            "arrival_to_decision_ms": [(e.decided_at - u.arrival_time) * 1000
                                       for u, e in events],
            "decision_to_unwind_ms": [(e.unwound_at - e.decided_at) * 1000 for _, e in events],
            "arrival_to_first_token_ms": first_tokens_ms,
            "first_token_within_slo": sum(ms <= slo_ms for ms in first_tokens_ms)}
        figures.update(_how_long_steps_ran(counters_before, counters_after, 2 * trials))
        self.record("size", **figures)
        return figures

    def _clean_step(self, req_id: str, prompt_tokens: int) -> float:
        """The seconds of one unpreempted long step."""
        self.engine.add_request(_request(req_id, self.prompt(prompt_tokens), RELAXED_SLO_MS))
        started = time.monotonic()
        self.engine.step()
        seconds = time.monotonic() - started
        _drain(self.engine)
        return seconds

    def _preempted_step(self, long: Request, urgent: Request,
                        delay_s: float) -> SLOPreemptionEvent | None:
        """One step of `long`, with `urgent` submitted `delay_s` into it from another thread
        (as the HTTP reader thread would); the unwind it caused, or None. Both requests are
        aborted after the step."""
        engine = self.engine

        def arrive() -> None:
            time.sleep(delay_s)
            urgent.arrival_time = time.monotonic()
            engine.submit_request(urgent)

        engine.add_request(long)
        events = engine.slo_preemption.events
        last_before = events[-1] if events else None
        arrival = threading.Thread(target=arrive, daemon=True)
        arrival.start()
        engine.step()
        arrival.join()
        event = events[-1] if events and events[-1] is not last_before else None
        if event is not None:
            self._serve_first_token(urgent)
        engine.abort_requests([long.request_id, urgent.request_id])
        return event

    def _serve_first_token(self, urgent: Request) -> None:
        """Step on after an unwind until `urgent` has its first token (whatever the scheduler
        puts beside it counts: that is what its client would wait for). These steps' graph
        replays are kept apart from the long steps' counters."""
        before = graph_counters(self.engine)
        while urgent.first_token_time is None and self.engine.has_unfinished_requests():
            self.engine.step()
        after = graph_counters(self.engine)
        if before is not None and after is not None:
            self.follow_up_counters = self.follow_up_counters + (after - before)


def _first_token_ms(urgent: Request) -> float:
    """Arrival to the urgent request's first token (the end of the step that sampled it, the
    device's queued work included), in ms; NaN if it never got one."""
    if urgent.first_token_time is None:
        return float("nan")
    return (urgent.first_token_time - urgent.arrival_time) * 1000


def _how_long_steps_ran(before: GraphCounters | None, after: GraphCounters | None,
                        long_steps: int) -> dict[str, Any]:
    """Between the two snapshots only the size's long steps ran (each trial: a clean one and
    one an urgent arrival may stop), so the counters' deltas are theirs."""
    if before is None or after is None:
        return {"long_step_ran_as": "unknown", "long_steps": long_steps,
                "long_steps_as_pieces": None, "unwinds_between_pieces": None,
                "decode_graph_replays": None}
    delta = after - before
    as_pieces = delta.piece_replays + delta.piece_unwinds
    return {"long_step_ran_as": ran_as(as_pieces, long_steps), "long_steps": long_steps,
            "long_steps_as_pieces": as_pieces, "unwinds_between_pieces": delta.piece_unwinds,
            "decode_graph_replays": delta.decode_replays}


def print_size(figures: dict[str, Any], num_layers: int, short_s: float,
               simulated_unwind_ms: float = 0.0) -> None:
    """One size's block of `key: value` lines; its first line names the size.
    `simulated_unwind_ms`: --simulate's profile sleeps this long to unwind (the device finishing
    its kernel and the host unwinding, which a real run measures as part of the wait), so the
    target allows it on top of the next layer boundary."""
    step_times = figures["long_step_ms"]
    ms = figures["arrival_to_unwind_ms"]
    layer_ms = figures["layer_ms"]
    unwinds = figures["unwinds_between_pieces"]
    print(f"layers: {num_layers}, prompt_tokens: {figures['prompt_tokens']}, threads: "
          f"{torch.get_num_threads()}")
    print(f"long_step_ran_as: {figures['long_step_ran_as']}")
    print(f"unwinds_between_pieces: {'-' if unwinds is None else unwinds}")
    print(f"long_step_ms_median: {statistics.median(step_times):.1f}")
    print(f"layer_ms: {layer_ms:.2f}")
    print(f"urgent_ttft_alone_ms: {short_s * 1000:.1f}, urgent_slo_ms: "
          f"{figures['urgent_slo_ms']:.1f}")
    print(f"trials: {figures['trials']}, unwound: {len(ms)}, "
          f"not_unwound: {figures['not_unwound']}")
    if not ms:
        return
    for q in (50, 90, 99):
        print(f"arrival_to_unwind_p{q}_ms: {percentile(ms, q):.2f}")
    print(f"arrival_to_unwind_max_ms: {max(ms):.2f}")
    print(f"arrival_to_decision_p50_ms: {statistics.median(figures['arrival_to_decision_ms']):.2f}")
    print(f"decision_to_unwind_p50_ms: {statistics.median(figures['decision_to_unwind_ms']):.2f}")
    p99 = percentile(ms, 99)
    print(f"arrival_to_unwind_p99_layers: {p99 / layer_ms:.2f}")
    first_tokens = [t for t in figures.get("arrival_to_first_token_ms", []) if t == t]
    if first_tokens:
        # What the urgent request's client sees: the unwind, the device's queued layers, and
        # its own step.
        for q in (50, 99):
            print(f"arrival_to_first_token_p{q}_ms: {percentile(first_tokens, q):.2f}")
        print(f"first_token_within_slo: {figures['first_token_within_slo']}/{len(ms)}")
    spread = ((percentile(step_times, 90) - percentile(step_times, 10))
              / statistics.median(step_times) * 100)
    print(f"long_step_p10_p90_spread_pct: {spread:.1f}")
    bound_ms = layer_ms + 5 + simulated_unwind_ms
    unwind = f" + simulated unwind {simulated_unwind_ms:.1f} ms" if simulated_unwind_ms else ""
    print(f"target: p99 < layer + 5 ms{unwind} = {bound_ms:.2f} ms -> "
          f"{'met' if p99 < bound_ms else 'NOT met'}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024],
                        help="the long prefill's size; several are measured in turn on one "
                             "engine (default: 1024)")
    parser.add_argument("--trials", type=int, default=30, help="per size")
    parser.add_argument("--monitor-interval-ms", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto (default): cuda when torch sees a GPU, else cpu (--simulate: "
                             "cpu)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: random weights for a config-only folder of a real shape "
                             "(engine/benchmarks/inputs/model_shapes.py)")
    parser.add_argument("--simulate", default=None, metavar="PROFILE",
                        help="the GPU-timed simulation (engine/simulation) at this profile's "
                             "speed; --model: a folder of its shape")
    parser.add_argument("--output", default=None, metavar="PATH",
                        help="also write the raw figures (every trial's) as JSON here at the "
                             "end, and each trial and size as it ends to PATH's .jsonl twin")
    parser.add_argument("--urgent-slo-ms", type=float, default=None,
                        help="default: the urgent request's isolated TTFT + 10%% of the long "
                             "step, both measured")


def main(argv: list[str] | None = None) -> int:
    """As a script (bench/e2e/): the same options as the subcommand."""
    return standalone_main(__doc__.split("\n\n")[0], add_arguments, run, argv)


def run(args: argparse.Namespace) -> int:
    """`sloserve bench latency`: the trials of every size, printed as `key: value` lines."""
    from engine.entrypoints.default_model import model_path_or_default

    model = model_path_or_default(args.model)
    # One step holds the largest prompt whole.
    config = build_engine_config(model, enable_prefix_caching=False, scheduling_policy="slo",
                                 max_num_batched_tokens=max(2048, max(args.prompt_tokens) + 64),
                                 monitor_interval_ms=args.monitor_interval_ms,
                                 device=args.device, dtype=args.dtype,
                                 load_format=args.load_format, simulate=args.simulate)
    engine = EngineCore(config)
    # Each trial and size as it ends, beside the final JSON (engine.benchmarks.measure.figures).
    log = FigureLog(jsonl_twin(args.output) if args.output else None)
    bench = LatencyBench(engine, args.seed, args.urgent_slo_ms, record=log.write)
    log.write("run", model=model, device=config.model.device, layers=bench.num_layers,
              threads=torch.get_num_threads(), prompt_tokens=args.prompt_tokens,
              trials=args.trials)
    try:
        # The engine is warm before the urgent request's own TTFT is timed.
        bench.warm_up(args.prompt_tokens[0])
        short_s = bench.measure_urgent_alone()
        log.write("urgent_alone", urgent_ttft_alone_ms=short_s * 1000)
        sizes = [bench.measure_size(n, args.trials) for n in args.prompt_tokens]
    finally:
        engine.shutdown()
    print(f"model: {model}")
    print(f"device: {config.model.device}")  # what --device auto chose
    simulated_unwind_ms = (load_profile(args.simulate, bench.num_layers).unwind_s * 1000
                           if args.simulate else 0.0)
    for figures in sizes:
        print_size(figures, bench.num_layers, short_s, simulated_unwind_ms)
    if args.output:
        report = {"model": model, "device": config.model.device, "layers": bench.num_layers,
                  "threads": torch.get_num_threads(), "urgent_ttft_alone_ms": short_s * 1000,
                  "sizes": sizes}
        Path(args.output).write_text(json.dumps(report, indent=2))
    log.write("done")
    log.close()
    return 0
