"""`sloserve calibrate`: fit the TTFT predictor (docs/design.md section 5) on this model and
machine, and write it as JSON for `sloserve serve --ttft-model FILE`.

Every prompt size is run once untimed first (a GPU compiles kernels for a new shape on first
use), then timed `--repeats` times round-robin; the median per size is fitted. Then decode steps
are timed: batches of requests with the same prompt length decode together (one untimed batch
per shape first), and their time per output token is one decode step over their contexts.

The candidates of monitor/step_model_choice.py are fitted on the prefill medians and the decode
medians together: the line, the line plus an attention term `b * tokens**2`, and each under a
host floor `max(floor, terms)` (on a GPU small steps all take the kernel-launch time). Each is
scored by predicting every prompt size from a fit on the others; a richer one is kept only if
it predicts them better. Every candidate's held-out error is printed."""

from __future__ import annotations

import argparse
import os
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.entrypoints.engine_args import add_engine_args, engine_kwargs, under_torchrun
from monitor.step_point import StepPoint
from monitor.step_time_model import StepTimeModel
from monitor.step_model_choice import choose_step_model

# Up to 3072: above about 1024 tokens prefill grows visibly faster than linearly (attention),
# which only the quadratic term can follow.
DEFAULT_PROMPT_SIZES = [16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072]
# Decode steps: each batch size with each context that fits one prefill step; lone long contexts
# and wide short batches separate the per-token cost from the per-context-token cost.
DEFAULT_DECODE_BATCHES = [1, 8]
DEFAULT_DECODE_CONTEXTS = [64, 256, 1024, 2048]
# Tokens each decode calibration request generates after its first.
DECODE_STEPS = 8


@dataclass
class CalibrationResult:
    points: list[tuple[int, float]]  # every measured (prompt tokens, seconds) pair
    medians: dict[int, float]  # prompt tokens -> median seconds
    model: StepTimeModel
    # Leave-one-size-out error of each candidate (root mean square of relative errors); None
    # where there are too few sizes to tell.
    held_out_error: dict[str, float | None]
    # (batch, prompt length) -> median seconds per decode step, and the fitted step points.
    decode_medians: dict[tuple[int, int], float] = field(default_factory=dict)


def choose_model(medians: dict[int, float],
                 decode_medians: dict[tuple[int, int], float] | None = None
                 ) -> tuple[StepTimeModel, dict[str, float | None]]:
    """The candidate that predicts held-out prompt sizes best (docs/design.md section 5: a
    richer model must beat the line on held-out data), fitted on every point, and each
    candidate's held-out error."""
    points = [StepPoint(n, n * n, 0, s) for n, s in medians.items()]
    points += [StepPoint(*decode_point(b, n, s)) for (b, n), s in (decode_medians or {}).items()]
    return choose_step_model(points)


def decode_point(batch: int, prompt_len: int, seconds: float) -> tuple[int, int, int, float]:
    """A decode calibration as a step point (tokens, attention, decode_context, seconds): the
    context is the mean over the timed steps, which read prompt_len + 1 .. + DECODE_STEPS."""
    context = prompt_len + (DECODE_STEPS + 1) // 2
    return (batch, 0, batch * context, seconds)


def time_decodes(llm: Any, shapes: Sequence[tuple[int, int]], repeats: int,
                 rng: random.Random, warmup: int = 1) -> dict[tuple[int, int], float]:
    """Median seconds per decode step for each (batch, prompt length): `batch` requests are
    prefilled in one step and then decode in lockstep, so each one's time per output token is
    the step time. Each shape runs `warmup` times untimed first."""
    from tqdm import tqdm

    from engine.sampling_params import SamplingParams

    vocab = llm.engine.vocab_size
    params = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0.0, ignore_eos=True)
    medians: dict[tuple[int, int], float] = {}
    for batch, prompt_len in tqdm(shapes, desc="Calibrating decodes", unit="shape"):
        times: list[float] = []
        for run in range(warmup + repeats):
            prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(prompt_len)]}
                       for _ in range(batch)]
            outputs = llm.generate(prompts, params)
            if run >= warmup:
                times += [out.metrics.tpot for out in outputs if out.metrics.tpot is not None]
        medians[(batch, prompt_len)] = statistics.median(times)
    return medians


def calibrate(llm: Any, prompt_sizes: Sequence[int], repeats: int = 3, warmup: int = 1,
              seed: int = 0, decode_shapes: Sequence[tuple[int, int]] = ()
              ) -> CalibrationResult:
    """Times scheduling -> first token for lone requests of each size (max_tokens=1).

    Each request runs alone so that its prefill is one engine step, which is what the predictor
    predicts for a request with nothing else in the batch."""
    from tqdm import tqdm

    from engine.sampling_params import SamplingParams

    sizes = sorted(set(prompt_sizes))
    rng = random.Random(seed)
    vocab = llm.engine.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0)
    # Warm-up passes first, then the measured passes round-robin over the sizes: a slow spell
    # (another process on the machine) spreads over all sizes instead of bending the line.
    plan = [(size, False) for _ in range(warmup) for size in sizes]
    plan += [(size, True) for _ in range(repeats) for size in sizes]
    points: list[tuple[int, float]] = []
    for size, measured in tqdm(plan, desc="Calibrating", unit="prompt"):
        # Fresh random tokens per request: no prefix-cache hit can shorten a prefill.
        prompt = {"prompt_token_ids": [rng.randrange(vocab) for _ in range(size)]}
        (out,) = llm.generate(prompt, params)
        m = out.metrics
        if m.num_cached_tokens:
            raise RuntimeError(f"a {size}-token calibration prompt hit the prefix cache "
                               f"({m.num_cached_tokens} tokens); disable prefix caching")
        if measured:
            points.append((size, m.first_token_time - m.first_scheduled_time))
    medians = {s: statistics.median(t for n, t in points if n == s) for s in sizes}
    decode_medians = (time_decodes(llm, decode_shapes, repeats, rng, warmup)
                      if decode_shapes else {})
    # Fit on the medians: one slow outlier per size cannot tilt the line.
    model, errors = choose_model(medians, decode_medians)
    if model.seconds_per_token <= 0:
        raise ValueError(f"prefill time does not grow with prompt size (slope "
                         f"{model.seconds_per_token:.3g} s/token over sizes {sizes}); "
                         f"use larger --prompt-sizes")
    return CalibrationResult(points=points, medians=medians, model=model, held_out_error=errors,
                             decode_medians=decode_medians)


def _check_output(path: Path) -> None:
    """Fails before minutes of measuring, not after, and without creating the file."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ValueError(f"--output {str(path)!r} is a directory")
    if not parent.is_dir() or not os.access(parent, os.W_OK) or (
            path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"--output {str(path)!r} is not writable")


def _usable_sizes(sizes: list[int], llm: Any) -> list[int]:
    """Keeps the sizes whose prefill is one step: within max_model_len - 1 (the first token needs
    a slot), the step token budget and the per-step prefill chunk threshold."""
    sched = llm.engine.config.scheduler
    limit = min(llm.engine.max_model_len - 1, sched.max_num_batched_tokens)
    if sched.long_prefill_token_threshold > 0:
        limit = min(limit, sched.long_prefill_token_threshold)
    skipped = [s for s in sizes if s > limit]
    if skipped:
        print(f"note: skipping prompt sizes {skipped}: above {limit} tokens (max_model_len - 1, "
              f"max_num_batched_tokens, long_prefill_token_threshold)")
    kept = [s for s in sizes if s <= limit]
    if len(set(kept)) < 2:
        raise ValueError(f"need two or more distinct prompt sizes <= {limit} tokens to fit a "
                         f"line, got {sorted(set(kept))}")
    return kept


def _usable_decode_shapes(batches: Sequence[int], contexts: Sequence[int],
                          llm: Any) -> list[tuple[int, int]]:
    """The (batch, prompt length) pairs whose batch prefills in one step and then decodes in
    lockstep: the batch's prompts within the step budget, and every sequence within
    max_model_len and, all together, the KV pool minus its watermark (else KV preemption would
    break the lockstep)."""
    engine = llm.engine
    sched = engine.config.scheduler
    step_limit = sched.max_num_batched_tokens
    if sched.long_prefill_token_threshold > 0:
        step_limit = min(step_limit, sched.long_prefill_token_threshold)
    kv = engine.scheduler.kv_cache_manager
    kv_tokens = (kv.pool.num_blocks - kv.watermark_blocks) * kv.block_size
    shapes: list[tuple[int, int]] = []
    for batch in sorted(set(batches)):
        for length in sorted(set(contexts)):
            total = length + DECODE_STEPS + 1
            per_sequence = -(-total // kv.block_size) * kv.block_size
            if (batch * length <= step_limit and total <= engine.max_model_len
                    and batch * per_sequence <= kv_tokens):
                shapes.append((batch, length))
    skipped = [(b, n) for b in sorted(set(batches)) for n in sorted(set(contexts))
               if (b, n) not in shapes]
    if skipped:
        print(f"note: skipping decode shapes (batch, context) {skipped}: the batch does not "
              f"prefill in one step or fit max_model_len and the KV pool")
    return shapes


def _run(args: argparse.Namespace) -> int:
    from engine.entrypoints.llm import LLM

    bad = [s for s in args.prompt_sizes if s < 1]
    if bad:
        raise ValueError(f"--prompt-sizes must be positive, got {bad}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    bad = [n for n in [*args.decode_batches, *args.decode_contexts] if n < 1]
    if bad:
        raise ValueError(f"--decode-batches and --decode-contexts must be positive, got {bad}")
    output = Path(args.output)
    _check_output(output)
    kwargs = engine_kwargs(args)
    kwargs["enable_prefix_caching"] = False  # a cache hit would shorten the measured prefill
    kwargs["startup_calibration"] = False  # this measures more than startup would
    if (code := under_torchrun(args, kwargs)) is not None:
        return code
    llm = LLM(**kwargs)
    try:
        sizes = _usable_sizes(args.prompt_sizes, llm)
        shapes = _usable_decode_shapes(args.decode_batches, args.decode_contexts, llm)
        result = calibrate(llm, sizes, args.repeats, args.warmup, seed=args.seed,
                           decode_shapes=shapes)
    finally:
        llm.shutdown()
    print(f"{'tokens':>8}  {'median ms':>10}")
    for size, seconds in result.medians.items():
        print(f"{size:>8}  {seconds * 1000:>10.2f}")
    if result.decode_medians:
        print(f"{'batch':>8}  {'context':>8}  {'ms per decode step':>18}")
        for (batch, length), seconds in result.decode_medians.items():
            print(f"{batch:>8}  {length:>8}  {seconds * 1000:>18.2f}")
    m = result.model
    for name, error in result.held_out_error.items():
        shown = "n/a (too few sizes)" if error is None else f"{error * 100:.1f}%"
        print(f"held-out error ({name}): {shown}")
    print(f"seconds_per_token: {m.seconds_per_token:.4g}")
    print(f"seconds_per_token_sq: {m.seconds_per_token_sq:.4g}")
    print(f"seconds_per_decode_context: {m.seconds_per_decode_context:.4g}")
    print(f"intercept_ms: {m.intercept_s * 1000:.2f}")
    print(f"floor_ms: {m.floor_s * 1000:.2f}")
    print(f"relative_error: {m.relative_error:.3f} (relative_speedup {m.relative_speedup:.3f})")
    print(f"r2: {m.r2:.4f}")
    try:
        m.save(output)
    except OSError as exc:
        raise ValueError(f"cannot write --output {str(output)!r}: {exc}") from exc
    print(f"wrote {output}")
    return 0


def add_calibrate_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("calibrate", help="fit the TTFT predictor on this model and machine")
    p.add_argument("--output", default="ttft_model.json",
                   help="JSON file for `serve --ttft-model` (default: ttft_model.json)")
    p.add_argument("--prompt-sizes", type=int, nargs="+", default=DEFAULT_PROMPT_SIZES,
                   help="prompt lengths to time (default: 16 .. 3072, capped at max_model_len "
                        "and max_num_batched_tokens)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per size (median is fit)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per size first")
    p.add_argument("--decode-batches", type=int, nargs="*", default=DEFAULT_DECODE_BATCHES,
                   help="decode batch sizes to time (default: 1 8)")
    p.add_argument("--decode-contexts", type=int, nargs="*", default=DEFAULT_DECODE_CONTEXTS,
                   help="prompt lengths the decodes read (default: 64 256 1024 2048; a batch "
                        "must prefill in one step; none: skip decode calibration)")
    add_engine_args(p)
    p.set_defaults(func=_run)
