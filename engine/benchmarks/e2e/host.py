"""The host's share of a step: the real engine loop against a simulated device.

EngineCore runs as in `sloserve serve`'s engine process: the scheduler, the slack policy, the
monitor thread, the output update, and each step's outputs encoded as that process sends them
to the API server. The executor is --simulate's (engine/executor/simulated.py): no model runs,
and the device is a stream that runs each decode step for the profile's time at that batch and
context (an H100 running Llama-3.1-8B by default), without the profile's eager-launch floor:
a measured profile's floor is the eager host launching kernels, which is what this benchmark
measures as host time instead.

Both loops run in one invocation, one after the other on the same requests: `serial`
(schedule -> execute -> update, the device idle for all of the host's work) and `async`
(--async-scheduling: the next decode step is scheduled and queued while the device runs this
one). At each batch size B, B requests with short prompts are prefilled, then decode together;
after a few warm-up steps, --steps decode-only iterations are timed. Per loop and batch it
prints the iteration, the device's step, the host's time (the iteration less the time the loop
slept waiting for the device), the host's cost per sequence, and the share of the timed window
the device was idle; then one JSON object.

Then, per loop and batch, `--arrivals` short requests arrive from another thread at random
moments of the decoding, as the HTTP reader hands them over, and the wait from each arrival to
the moment its prefill starts on the device is printed (median and largest, in ms and in decode
steps): the bound async scheduling puts on an urgent arrival (the step running and at most one
queued behind it, against the step running alone in the serial loop).

What this does not count: a real model runner's input preparation and sampling
(`bench/diagnostics/step_profile.py` times those on this CPU's real model), and the transport
to tensor-parallel workers.

    sloserve bench host
    sloserve bench host --batches 1 16 64 256 --steps 50 --simulate h100-llama-3.1-8b
    sloserve bench host --loops async --batches 64 --profile   # where the loop's time goes
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.benchmarks.standalone import standalone_main

# The profile's model shape, for each shipped profile (the simulated model folder needs its
# layer count and vocabulary).
PROFILE_SHAPES = {"h100-llama-3.1-8b": "llama-3.1-8b", "h100-llama-3.1-8b-fp8": "llama-3.1-8b",
                  "h100-qwen3-30b-a3b": "qwen3-30b-a3b", "h200-mixtral-8x7b": "mixtral-8x7b"}
WARM_UP_STEPS = 5


@dataclass
class BatchFigures:
    """One loop's timed decode iterations at one batch size (medians over the steps, in
    milliseconds), and the waits of the arrivals during them."""

    loop: str
    batch: int
    steps: int
    iteration_ms: float
    device_ms: float
    host_ms: float
    host_us_per_sequence: float
    device_idle_pct: float
    arrival_wait_ms: list[float]

    @property
    def arrival_wait_steps(self) -> list[float]:
        return [wait / self.device_ms for wait in self.arrival_wait_ms]


class PrefillStarts:
    """A step observer: when each arrival's first step started on the device (the executor's
    latest step, once the loop has run or queued it)."""

    def __init__(self, executor: Any) -> None:
        self.executor = executor
        self.started: dict[str, float] = {}

    def __call__(self, timing: Any) -> None:
        if timing.scheduled is None:
            return
        for r in timing.scheduled.requests:
            if r.req_id.startswith("arrival-") and r.req_id not in self.started:
                self.started[r.req_id] = self.executor.last_step_start

def _requests(batch: int, prompt_tokens: int, max_tokens: int, vocab: int, first: int) -> list:
    from engine import SamplingParams
    from engine.core.request import Request

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [Request(request_id=f"host-{first + i}",
                    prompt_token_ids=[(31 * (first + i) + 7 * j) % (vocab - 10) + 5
                                      for j in range(prompt_tokens)],
                    sampling_params=params)
            for i in range(batch)]


def max_tokens_for(batch: int, prompt_tokens: int, steps: int, budget: int = 2048) -> int:
    """Enough tokens for the first request prefilled to still decode in the last timed step:
    it decodes while the others prefill, their chunks sharing each step's budget with the
    decodes (hence the factor 2)."""
    prefill_steps = -(-batch * prompt_tokens // budget) + 1
    return 2 * prefill_steps + WARM_UP_STEPS + steps + 8


def measure_batch(core: Any, loop: str, batch: int, steps: int, prompt_tokens: int,
                  arrivals: int, first_id: int, seed: int,
                  profiler: cProfile.Profile | None = None) -> BatchFigures:
    """Prefill `batch` requests, time `steps` decode-only iterations of the loop as the engine
    process runs it (step, then encode what it would send), then time `arrivals` arrivals."""
    from engine.ipc.core_messages import CoreOutputs, frame

    stream = core.executor.stream
    requests = _requests(batch, prompt_tokens,
                         max_tokens_for(batch, prompt_tokens, steps + ARRIVAL_STEPS * arrivals),
                         core.vocab_size, first_id)
    for request in requests:
        core.add_request(request)
    # Prefill (any number of steps), then a few decode steps to warm up.
    decodes = 0
    while decodes < WARM_UP_STEPS:
        outputs = core.step()
        frame(CoreOutputs(outputs=outputs, stats=core.stats()))
        running = core.scheduler.running
        if len(running) == batch and all(r.num_output_tokens >= 1 for r in running):
            decodes += 1
    iterations: list[float] = []
    lengths: list[int] = []
    if profiler is not None:
        profiler.enable()
    waited = stream.waited_s
    begin = time.perf_counter()
    for _ in range(steps):
        started = time.perf_counter()
        outputs = core.step()
        frame(CoreOutputs(outputs=outputs, stats=core.stats()))
        iterations.append(time.perf_counter() - started)
        lengths.append(len(outputs))
    end = time.perf_counter()
    if profiler is not None:
        profiler.disable()
    if any(n != batch for n in lengths):
        raise RuntimeError(f"batch {batch}: the timed steps were not all {batch}-way decodes "
                           f"({lengths}): raise the KV pool or max_num_seqs")
    window = end - begin
    host = (window - (stream.waited_s - waited)) / steps
    device = statistics.median(e - s for s, e in list(stream.busy)[-steps:])
    idle = 1 - stream.busy_seconds(begin, end) / window
    waits = _arrival_waits(core, arrivals, device, first_id, seed)
    core.abort_requests([r.request_id for r in requests])
    while core.has_unfinished_requests():  # the step in flight, read back
        core.step()
    return BatchFigures(loop=loop, batch=batch, steps=steps,
                        iteration_ms=statistics.median(iterations) * 1e3,
                        device_ms=device * 1e3, host_ms=host * 1e3,
                        host_us_per_sequence=host / batch * 1e6,
                        device_idle_pct=100 * max(0.0, idle), arrival_wait_ms=waits)


# Decode steps between two timed arrivals (the engine goes back to decoding ahead in between).
ARRIVAL_STEPS = 6


def _arrival_waits(core: Any, arrivals: int, decode_s: float, first_id: int,
                   seed: int) -> list[float]:
    """Each arrival comes at a random moment of a decode step (from a timer thread, as the HTTP
    reader hands requests over); the wait is from then to its first step's start on the
    device, in ms."""
    from engine import SamplingParams
    from engine.core.request import Request

    rng = random.Random(seed + first_id)
    starts = PrefillStarts(core.executor)
    core.step_observers.append(starts)
    arrived: dict[str, float] = {}
    try:
        for i in range(arrivals):
            request = Request(request_id=f"arrival-{first_id}-{i}",
                              prompt_token_ids=[5 + (i + j) % 50 for j in range(16)],
                              sampling_params=SamplingParams(temperature=0, max_tokens=1))

            def arrive(request: Request = request) -> None:
                request.arrival_time = time.monotonic()
                arrived[request.request_id] = time.perf_counter()
                core.submit_request(request)

            timer = threading.Timer(rng.uniform(1.0, 2.0) * decode_s, arrive)
            timer.start()
            for _ in range(ARRIVAL_STEPS):
                core.step()
            timer.join()
            while request.request_id not in starts.started:
                core.step()
    finally:
        core.step_observers.remove(starts)
    return [1e3 * (starts.started[rid] - at) for rid, at in arrived.items()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--simulate", default="h100-llama-3.1-8b", metavar="PROFILE",
                        choices=sorted(PROFILE_SHAPES),
                        help="the device profile whose step times the device takes "
                             "(default: %(default)s)")
    parser.add_argument("--loops", nargs="+", choices=LOOPS, default=list(LOOPS),
                        help="the engine loops to measure, one after the other (default: both)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256],
                        help="decode batch sizes (default: 1 16 64 256)")
    parser.add_argument("--steps", type=int, default=50, help="timed decode steps per batch")
    parser.add_argument("--arrivals", type=int, default=10,
                        help="arrivals timed per loop and batch, after its decode steps")
    parser.add_argument("--prompt-tokens", type=int, default=512,
                        help="each request's prompt (the decode context grows from it)")
    parser.add_argument("--seed", type=int, default=0, help="the arrivals' moments")
    parser.add_argument("--no-monitor", action="store_true",
                        help="FCFS without the slack monitor (the default runs the slo policy "
                             "and its monitor thread, as `sloserve serve` does)")
    parser.add_argument("--profile", action="store_true",
                        help="run the timed steps under cProfile and print where the loop's "
                             "time goes (to stderr; the figures then include its overhead)")
    parser.add_argument("--output", default=None, help="also write the JSON figures here")


LOOPS = ("serial", "async")


def build_core(args: argparse.Namespace, folder: Path, loop: str) -> Any:
    import msgspec

    from engine.config import build_engine_config
    from engine.runtime.engine_core import EngineCore

    batch = max(args.batches)
    max_len = args.prompt_tokens + max_tokens_for(batch, args.prompt_tokens,
                                                  args.steps + ARRIVAL_STEPS * args.arrivals)
    blocks_per_request = -(-max_len // 16) + 1
    config = build_engine_config(
        str(folder), simulate=args.simulate, max_model_len=max(max_len, 256),
        max_num_seqs=batch + 1, max_num_batched_tokens=2048,
        num_kv_blocks=(batch + 1) * blocks_per_request + 64, enable_prefix_caching=False,
        scheduling_policy="fcfs" if args.no_monitor else "slo",
        slo_preemption=not args.no_monitor, startup_calibration=False,
        async_scheduling=loop == "async")
    core = EngineCore(config)
    # The device's time without the profile's floor (see the module docstring).
    executor = core.executor
    executor.profile = msgspec.structs.replace(executor.profile, floor_s=0.0)
    return core


def run(args: argparse.Namespace) -> int:
    from engine.benchmarks.inputs.model_shapes import write_shape
    from engine.benchmarks.inputs.random_checkpoints import save_small_tokenizer

    work = Path(tempfile.mkdtemp(prefix="sloserve-host-"))
    folder = write_shape(PROFILE_SHAPES[args.simulate], work / "shape",
                         save_small_tokenizer(work / "tokenizer"))
    profiler = cProfile.Profile() if args.profile else None
    figures: list[BatchFigures] = []
    for loop in args.loops:
        core = build_core(args, folder, loop)
        try:
            first_id = 0
            for batch in args.batches:
                figures.append(measure_batch(core, loop, batch, args.steps, args.prompt_tokens,
                                             args.arrivals, first_id, args.seed, profiler))
                first_id += batch
        finally:
            core.shutdown()
    print(f"profile {args.simulate} (no launch floor), policy "
          f"{'fcfs' if args.no_monitor else 'slo + monitor'}, {args.steps} decode steps per "
          f"batch, prompts of {args.prompt_tokens} tokens; medians in ms")
    print(f"{'loop':>6s} {'batch':>5s} {'iteration':>9s} {'device':>8s} {'host':>7s} "
          f"{'host us/seq':>11s} {'device idle':>11s} {'arrival wait ms (steps)':>28s}")
    for f in figures:
        waits = (f"{statistics.median(f.arrival_wait_ms):6.2f} ({statistics.median(f.arrival_wait_steps):4.2f})"
                 f" max {max(f.arrival_wait_ms):6.2f} ({max(f.arrival_wait_steps):4.2f})"
                 if f.arrival_wait_ms else "-")
        print(f"{f.loop:>6s} {f.batch:5d} {f.iteration_ms:9.3f} {f.device_ms:8.3f} "
              f"{f.host_ms:7.3f} {f.host_us_per_sequence:11.1f} {f.device_idle_pct:10.1f}% "
              f"{waits:>28s}")
    result = {"profile": args.simulate, "policy": "fcfs" if args.no_monitor else "slo",
              "prompt_tokens": args.prompt_tokens, "batches": [asdict(f) for f in figures]}
    print(json.dumps(result))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
        print(text.getvalue(), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """As a script: the same options as the subcommand."""
    return standalone_main(__doc__.split("\n\n")[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
