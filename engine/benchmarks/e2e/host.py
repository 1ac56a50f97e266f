"""The host's share of a step: the real engine loop against a simulated device.

EngineCore runs as in `sloserve serve`'s engine process: the scheduler, the slack policy, the
monitor thread, the output update, and each step's outputs encoded as that process sends them
to the API server. The executor is --simulate's (engine/executor/simulated.py): no model runs,
and a decode step keeps the device busy for the profile's time at that batch and context (an
H100 running Llama-3.1-8B by default). Whatever else an iteration of the loop takes is host
time, and since the loop runs schedule -> execute -> update in series, the device sits idle for
all of it.

At each batch size B, B requests with short prompts are prefilled, then decode together; after
a few warm-up steps, --steps decode-only iterations are timed. Per batch it prints the
iteration, the device's busy time, the host's time split into the loop's own (scheduling,
update, output encoding: everything outside `execute_model`) and the executor's (its
bookkeeping and the simulated sampler, plus how late the OS woke its sleep), the host's cost
per sequence, and the share of the iteration the device was idle; then one JSON object.

What this does not count: a real model runner's input preparation and sampling
(`bench/diagnostics/step_profile.py` times those on this CPU's real model), and the transport
to tensor-parallel workers.

    sloserve bench host
    sloserve bench host --batches 1 16 64 256 --steps 50 --simulate h100-llama-3.1-8b
    sloserve bench host --batches 64 --profile        # where the loop's time goes (cProfile)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
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
    """One batch size's timed decode iterations (medians over the steps, in milliseconds)."""

    batch: int
    steps: int
    iteration_ms: float
    device_ms: float
    host_ms: float
    loop_host_ms: float
    executor_host_ms: float
    host_us_per_sequence: float
    device_idle_pct: float


class DeviceClock:
    """Wraps the simulated executor's `execute_model`: the wall time of each call, and the
    device time the profile gave the step it ran (what its sleep waited for).

    The device's time is the profile's work without its floor: a measured profile's floor is
    the eager host launching kernels (the shipped H100 profile's decode steps take 30 ms, host
    bound), which is what this benchmark measures as host time instead. Without it the H100
    profile's decode step at 512 tokens of context takes 4.1 ms at batch 1 and 7.6 ms at 64,
    against the 6.35 and 8.15 ms the profiler measured the GPU busy there with CUDA graphs
    (bench/results/gpu_h100_2026-11-27/call4/throughput-hf.log): a shorter device time, so the
    host's share reads larger, not smaller."""

    def __init__(self, executor: Any) -> None:
        import msgspec

        executor.profile = msgspec.structs.replace(executor.profile, floor_s=0.0)
        self.profile = executor.profile
        self._execute = executor.execute_model
        executor.execute_model = self
        self.last_wall_s = 0.0
        self.last_device_s = 0.0

    def __call__(self, scheduler_output: Any) -> Any:
        started = time.perf_counter()
        output = self._execute(scheduler_output)
        self.last_wall_s = time.perf_counter() - started
        self.last_device_s = self._device_seconds(scheduler_output)
        return output

    def _device_seconds(self, scheduler_output: Any) -> float:
        tokens = attention = decode_context = 0
        for r in scheduler_output.requests:
            n = len(r.token_ids)
            tokens += n
            if n == 1:
                decode_context += r.start_pos + 1
            else:
                attention += n * (2 * r.start_pos + n)
        return self.profile.step_seconds(tokens, attention, decode_context)


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


def measure_batch(core: Any, clock: DeviceClock, batch: int, steps: int, prompt_tokens: int,
                  first_id: int, profiler: cProfile.Profile | None = None) -> BatchFigures:
    """Prefill `batch` requests, then time `steps` decode-only iterations of the loop as the
    engine process runs it (step, then encode what it would send)."""
    from engine.ipc.core_messages import CoreOutputs, frame

    requests = _requests(batch, prompt_tokens, max_tokens_for(batch, prompt_tokens, steps),
                         core.vocab_size, first_id)
    for request in requests:
        core.add_request(request)
    # Prefill (any number of steps), then a few decode steps to warm up.
    decodes = 0
    while decodes < WARM_UP_STEPS:
        outputs = core.step()
        frame(CoreOutputs(outputs=outputs, stats=core.stats()))
        scheduled = core.scheduler.running
        if len(scheduled) == batch and all(r.num_output_tokens >= 1 for r in scheduled):
            decodes += 1
    iterations: list[float] = []
    executes: list[float] = []
    devices: list[float] = []
    if profiler is not None:
        profiler.enable()
    for _ in range(steps):
        started = time.perf_counter()
        outputs = core.step()
        frame(CoreOutputs(outputs=outputs, stats=core.stats()))
        iterations.append(time.perf_counter() - started)
        executes.append(clock.last_wall_s)
        devices.append(clock.last_device_s)
    if profiler is not None:
        profiler.disable()
    if len(outputs) != batch:
        raise RuntimeError(f"batch {batch}: the timed steps were not all {batch}-way decodes "
                           f"(the last returned {len(outputs)} outputs): raise the KV pool or "
                           f"max_num_seqs")
    core.abort_requests([r.request_id for r in requests])
    iteration = statistics.median(iterations)
    device = statistics.median(devices)
    execute = statistics.median(executes)
    host = iteration - device
    return BatchFigures(batch=batch, steps=steps, iteration_ms=iteration * 1e3,
                        device_ms=device * 1e3, host_ms=host * 1e3,
                        loop_host_ms=(iteration - execute) * 1e3,
                        executor_host_ms=(execute - device) * 1e3,
                        host_us_per_sequence=host / batch * 1e6,
                        device_idle_pct=100 * host / iteration)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--simulate", default="h100-llama-3.1-8b", metavar="PROFILE",
                        choices=sorted(PROFILE_SHAPES),
                        help="the device profile whose step times the device takes "
                             "(default: %(default)s)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256],
                        help="decode batch sizes (default: 1 16 64 256)")
    parser.add_argument("--steps", type=int, default=50, help="timed decode steps per batch")
    parser.add_argument("--prompt-tokens", type=int, default=512,
                        help="each request's prompt (the decode context grows from it)")
    parser.add_argument("--no-monitor", action="store_true",
                        help="FCFS without the slack monitor (the default runs the slo policy "
                             "and its monitor thread, as `sloserve serve` does)")
    parser.add_argument("--profile", action="store_true",
                        help="run the timed steps under cProfile and print where the loop's "
                             "time goes (to stderr; the figures then include its overhead)")
    parser.add_argument("--output", default=None, help="also write the JSON figures here")


def build_core(args: argparse.Namespace, folder: Path) -> Any:
    from engine.config import build_engine_config
    from engine.runtime.engine_core import EngineCore

    batch = max(args.batches)
    max_len = args.prompt_tokens + max_tokens_for(batch, args.prompt_tokens, args.steps)
    blocks_per_request = -(-max_len // 16) + 1
    config = build_engine_config(
        str(folder), simulate=args.simulate, max_model_len=max(max_len, 256),
        max_num_seqs=batch, max_num_batched_tokens=2048,
        num_kv_blocks=batch * blocks_per_request + 64, enable_prefix_caching=False,
        scheduling_policy="fcfs" if args.no_monitor else "slo",
        slo_preemption=not args.no_monitor, startup_calibration=False)
    return EngineCore(config)


def run(args: argparse.Namespace) -> int:
    from engine.benchmarks.inputs.model_shapes import write_shape
    from engine.benchmarks.inputs.random_checkpoints import save_small_tokenizer

    work = Path(tempfile.mkdtemp(prefix="sloserve-host-"))
    folder = write_shape(PROFILE_SHAPES[args.simulate], work / "shape",
                         save_small_tokenizer(work / "tokenizer"))
    core = build_core(args, folder)
    clock = DeviceClock(core.executor)
    profiler = cProfile.Profile() if args.profile else None
    figures: list[BatchFigures] = []
    try:
        first_id = 0
        for batch in args.batches:
            figures.append(measure_batch(core, clock, batch, args.steps, args.prompt_tokens,
                                         first_id, profiler))
            first_id += batch
    finally:
        core.shutdown()
    print(f"profile {args.simulate}, policy {'fcfs' if args.no_monitor else 'slo + monitor'}, "
          f"{args.steps} decode steps per batch, prompts of {args.prompt_tokens} tokens; "
          f"medians in ms")
    print(f"{'batch':>5s} {'iteration':>9s} {'device':>8s} {'host':>7s} {'loop':>7s} "
          f"{'executor':>8s} {'host us/seq':>11s} {'device idle':>11s}")
    for f in figures:
        print(f"{f.batch:5d} {f.iteration_ms:9.3f} {f.device_ms:8.3f} {f.host_ms:7.3f} "
              f"{f.loop_host_ms:7.3f} {f.executor_host_ms:8.3f} {f.host_us_per_sequence:11.1f} "
              f"{f.device_idle_pct:10.1f}%")
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
