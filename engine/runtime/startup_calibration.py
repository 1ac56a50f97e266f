"""Startup calibration: the engine times its own steps before serving, so that the TTFT predictor
knows this model on this machine from the first request (docs/design.md section 5).

The pessimistic default seed (a 135M model on 2 CPU cores) is 10-100x off on a GPU, and online
refits from served steps take many steps to correct it. So, when the engine will use the
predictor and no `--ttft-model` file is given, EngineCore runs, within a time budget:

- prompt sizes from 16 tokens up to the step budget (x4 apart, the budget itself last), each
  once untimed (a GPU compiles kernels for new shapes on first use) and then timed (median of
  up to three runs), the last run decoding a few tokens over that context; where most of them
  ran at a launch floor (a GPU's), sizes between those above it, until a floor model can be
  scored (_next_size_above_floor);
- one prompt as long as the longest context a served decode can read (max_model_len or the KV
  pool; halved until the time left affords it), prefilled in chunks and then decoding: a share
  of the budget is kept for it, so the decode term is measured at serving's contexts even when
  the prompt sizes run the budget short;
- a batch of eight short prompts decoding together;
- one prompt prefilled in chunks, whose chunks over ever deeper prefixes show the attention
  term (the first two untimed; the median chunk is the point).

Sizes are tried cheapest first, and one is skipped once its predicted cost would overrun the
budget. The points are fitted by monitor/step_model_choice.py (the attention term, the decode
term and a floor are kept where they predict held-out sizes better) and seed the engine's
StepTimePredictor, points included.

Nothing measured is thrown away. On a machine slower than the budget was made for (busy with
other processes, throttled), the budget extends until CONFIDENT_SIZES prompt sizes are timed,
up to MAX_BUDGET_FACTOR times itself; where even that times fewer, the fit rests on what was
timed (one size: a line through it and its decode steps) and is marked unconfident, which the
online fit and the policy read (monitor.step_time_model.StepTimeModel.confident): served steps
refit it from the first, and it writes no request off as doomed.

It drives the executor through its protocol only (`execute_model(SchedulerOutput)`), with a
throwaway fcfs Scheduler of its own over the same number of KV blocks (prefix caching off): no
request, counter, metric or step id of the engine's scheduler is touched. The scratch KV it
writes is harmless because the engine's pool is all free (and uncached) at startup. That
scheduler has the model's max_model_len, so no sequence it schedules reaches past it (a prompt
is at most max_model_len - 1 tokens and stops at the context like any request;
tests/engine/test_startup_within_max_model_len.py checks every step the runner sees).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import math
import os
import random
import statistics
import time
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.long_rope import long_rope_threshold
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput, StepStatus
from engine.entrypoints.arg_types import non_negative_float
from engine.executor.base import Executor
from engine.runtime.model_setup import ResolvedModel
from engine.sampling_params import SamplingParams
from monitor.predictor import CONFIDENT_SIZES
from monitor.step_model_choice import MIN_POINTS_ABOVE_FLOOR, choose_step_model
from monitor.step_point import StepPoint
from monitor.step_time_fit import FLOOR_TOLERANCE, fit_step, with_range
from monitor.step_time_model import StepTimeModel

logger = logging.getLogger(__name__)

# Wall time the measurements may take (engine start on the default model on 2 CPU cores: a
# 1024-token prefill takes about a second there; on a GPU every size fits many times over).
STARTUP_BUDGET_S = 5.0
# Overrides it (seconds): the test suite starts hundreds of engines and keeps this short.
BUDGET_ENV = "SLOSERVE_STARTUP_CALIBRATION_S"
# Where the budget would time fewer prompt sizes than a confident fit needs
# (monitor.predictor.CONFIDENT_SIZES), it extends up to this many times itself (_time_prompts).
MAX_BUDGET_FACTOR = 2.0
SMALLEST_PROMPT = 16
LADDER_FACTOR = 4
TIMED_REPEATS = 3
# A size whose one run would take more than this share of the budget is timed once.
ONE_REPEAT_SHARE = 0.1
# A cost estimate from a fit on smaller sizes is this much short of the truth at worst (the
# attention term shows only at the top).
COST_SAFETY = 1.2
# Decodes follow each prompt size's last run (one decode over its context), and one batch of
# this many short prompts decodes together.
DECODE_BATCH = 8
DECODE_STEPS = 4  # the first untimed
# Chunks of the deep-prefix prompt: at most this many, of a size at most a third of the budget.
MAX_CHUNKS = 8
# Share of the budget kept for one decode over a long context (the longest a served decode can
# have, or the longest that share affords): decodes timed only after short prompts once left
# the decode term to be extrapolated 15x past the longest context measured.
LONG_DECODE_SHARE = 0.35
# A long-context decode is timed only if it reaches this many times the longest context timed.
LONG_DECODE_GAIN = 1.5


@dataclass
class StartupCalibration:
    model: StepTimeModel
    # Every point fitted (medians): prompt sizes, decode batches, a chunk over a prefix.
    points: list[StepPoint]
    held_out_error: dict[str, float | None]
    seconds: float


def wants_startup_calibration(config: EngineConfig) -> bool:
    """Whether the engine will use the predictor with nothing better to seed it."""
    slo_preemption = config.slo_preemption
    return (slo_preemption.startup_calibration and slo_preemption.ttft_model is None
            and (config.scheduler.policy == "slo" or slo_preemption.enabled))


def log_uncalibrated_start() -> None:
    """What the predictor starts from when the startup calibration is off (and no TTFT
    model was given): said once in the log, as a calibration's result is."""
    logger.info("startup calibration off: the predictor starts from its default seed, "
                "unconfident (wide margins, no request written off) until served prefills "
                "have measured this machine")


class CalibrationStepError(RuntimeError):
    """A worker failed a calibration step: the engine cannot serve either."""


class _Scratch:
    """A throwaway scheduler feeding the executor; its requests never leave this object."""

    def __init__(self, executor: Executor, config: EngineConfig, model: ResolvedModel) -> None:
        assert model.num_blocks is not None
        # Our own copies: fcfs (it ranks nothing), chunks only when set_chunk asks for them.
        self.scheduler_config = dataclasses.replace(
            config.scheduler, policy="fcfs", long_prefill_token_threshold=0,
            enable_chunked_prefill=True)
        cache = dataclasses.replace(config.cache, enable_prefix_caching=False,
                                    num_blocks=model.num_blocks)
        self.scheduler = Scheduler(self.scheduler_config, cache, model.num_blocks,
                                   model.max_model_len,
                                   long_rope_after=long_rope_threshold(model.hf_config),
                                   kv_groups=model.kv_groups)
        self.executor = executor
        self.vocab_size = model.hf_config.vocab_size
        self.rng = random.Random(0)
        self.ids = 0

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV the free pool holds for one request, at worst: a block in every KV
        cache group per block of tokens (engine.core.kv_groups)."""
        kv = self.scheduler.kv_cache_manager
        return kv.num_free_blocks // len(kv.groups) * kv.block_size

    def set_chunk(self, tokens: int) -> None:
        """Prefill in chunks of `tokens` from now on (0: whole prompts). The scheduler and its
        admission read this config at every step."""
        self.scheduler_config.long_prefill_token_threshold = tokens

    def run(self, prompt_lens: list[int], max_tokens: int,
            deadline: float = math.inf) -> list[tuple[StepPoint, bool]]:
        """Runs fresh random prompts to completion, or until the step that ends past
        `deadline` (time.monotonic()); each step's point and whether it is a decode-only
        step."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for length in prompt_lens:
            self.ids += 1
            self.scheduler.add_request(Request(
                request_id=f"startup-calibration-{self.ids}", sampling_params=params,
                prompt_token_ids=[self.rng.randrange(self.vocab_size) for _ in range(length)]))
        steps: list[tuple[StepPoint, bool]] = []
        while self.scheduler.has_unfinished_requests():
            output = self.scheduler.schedule()
            if output.is_empty:  # cannot happen with the sizes checked; never spin
                raise CalibrationStepError(f"startup calibration: prompts of {prompt_lens} "
                                           f"tokens could not be scheduled")
            result = self.executor.execute_model(output)
            if result.status is not StepStatus.OK:
                raise CalibrationStepError(f"startup calibration: step {output.step_id} "
                                           f"failed on a worker:\n{result.error}")
            self.scheduler.update_from_output(output, result)
            steps.append((_full_step_point(output, result.execute_seconds),
                          all(len(r.token_ids) == 1 for r in output.requests)))
            if time.monotonic() > deadline:  # the machine is slower than the plan thought
                self.scheduler.abort_requests(list(self.scheduler.requests))
        return steps


def _full_step_point(output: SchedulerOutput, seconds: float) -> StepPoint:
    return StepPoint(output.num_scheduled_tokens, output.attention_work, output.decode_context,
                     seconds)


def _median_point(points: list[StepPoint]) -> StepPoint:
    """Mean features, median time: one slow run cannot tilt the fit."""
    n = len(points)
    return StepPoint(sum(p.tokens for p in points) / n, sum(p.attention for p in points) / n,
                     sum(p.decode_context for p in points) / n,
                     statistics.median(p.seconds for p in points))


class _Plan:
    """The measurements so far and the time left for more."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.max_budget_s = MAX_BUDGET_FACTOR * budget_s
        self.started = time.monotonic()
        self.prefills: dict[int, StepPoint] = {}
        self.decodes: dict[tuple[int, int], StepPoint] = {}
        self.chunks: list[StepPoint] = []

    @property
    def deadline(self) -> float:
        return self.started + self.budget_s

    @property
    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def extend(self, seconds: float) -> None:
        self.budget_s += seconds

    def estimate(self, tokens: int, attention: int, decode_context: int = 0) -> float:
        """Seconds for a step, from a line through the prompt sizes timed so far (before there
        are two, through the one and the decodes that followed it: see sparse_model), with
        COST_SAFETY to spare."""
        points = list(self.prefills.values())
        if not points:
            return 0.0
        if len(points) < 2:
            line = sparse_model(points, list(self.decodes.values()))
        else:
            line = fit_step(points, quadratic=len(points) >= 3, decode=False)
        return COST_SAFETY * line.predict_step(tokens, attention, decode_context)

    @property
    def largest(self) -> int:
        return max(self.prefills, default=0)

    @property
    def points(self) -> list[StepPoint]:
        return [*self.prefills.values(), *self.decodes.values(), *self.chunks]


def sparse_model(prefills: list[StepPoint], decodes: list[StepPoint]) -> StepTimeModel:
    """The step model where one prompt size was timed: a line through it and the decode steps
    (a decode step is a step of one token per sequence: what a step costs besides its tokens
    shows there), or, without decodes, the prompt's time per token. Unconfident
    (StepTimeModel.confident): it dooms nobody, and served steps refit it from the first."""
    points = [*prefills, *decodes]
    try:
        line = fit_step(points, quadratic=False, decode=False)
    except ValueError:  # one size in all
        line = None
    if line is None or line.seconds_per_token <= 0:
        # One size, or sizes that all ran as fast (a launch floor): what a token costs does
        # not show; the prompt's time per token overestimates it, which underestimates slack.
        largest = max(prefills, key=lambda p: p.tokens)
        line = StepTimeModel(seconds_per_token=largest.seconds / largest.tokens, intercept_s=0.0)
    return dataclasses.replace(with_range(line, points), confident=False)


def _split_at_floor(plan: _Plan) -> tuple[list[int], list[int]]:
    """The prompt sizes timed that ran as fast as the fastest (within FLOOR_TOLERANCE), and
    those above it, each in ascending order."""
    fastest = min(p.seconds for p in plan.prefills.values())
    at_floor = sorted(n for n, p in plan.prefills.items()
                      if p.seconds <= fastest * (1 + FLOOR_TOLERANCE))
    return at_floor, sorted(n for n in plan.prefills if n not in at_floor)


def _floor_bound(plan: _Plan) -> bool:
    """Whether every prompt size timed ran as fast as the fastest (within FLOOR_TOLERANCE)."""
    return not _split_at_floor(plan)[1]


def _prompt_ladder(limit: int) -> list[int]:
    sizes, size = [], SMALLEST_PROMPT
    while size < limit:
        sizes.append(size)
        size *= LADDER_FACTOR
    return [*sizes, limit]


def _time_prompts(scratch: _Scratch, plan: _Plan, limit: int, reserve_s: float = 0.0) -> None:
    """The prompt sizes, cheapest first, while the budget less `reserve_s` lasts (the ladder,
    then the sizes a floor's fit needs: _next_size_above_floor). The last timed run of each
    size also decodes a few tokens: decodes over the longest context come almost free.

    The budget adapts to the machine: where it would stop short of CONFIDENT_SIZES sizes (a
    busy or slow machine, whose first steps ran slower than the budget was made for), the next
    sizes are timed once each on a budget extended for them, up to MAX_BUDGET_FACTOR times the
    budget in all."""
    for size in _prompt_ladder(limit):
        if not _time_prompt(scratch, plan, size, reserve_s, extend=True):
            return
    while (size := _next_size_above_floor(plan)) is not None:
        if not _time_prompt(scratch, plan, size, reserve_s, extend=False):
            return


def _time_prompt(scratch: _Scratch, plan: _Plan, size: int, reserve_s: float,
                 extend: bool) -> bool:
    """Times one prompt size (untimed once, then the median of up to TIMED_REPEATS runs);
    False, timing nothing, where the budget left cannot afford it (`extend`: extended for it
    while fewer than CONFIDENT_SIZES sizes are timed, see _time_prompts)."""
    one_run = plan.estimate(size, size * size)
    repeats = TIMED_REPEATS if one_run < ONE_REPEAT_SHARE * plan.budget_s else 1
    decodes = DECODE_STEPS * plan.estimate(1, 0, size)
    if plan.prefills and (1 + repeats) * one_run + decodes > plan.left_s - reserve_s:
        if not extend or len(plan.prefills) >= CONFIDENT_SIZES:
            return False  # each larger size costs more
        repeats = 1
        short = 2 * one_run + decodes - (plan.left_s - reserve_s)
        if plan.budget_s + short > plan.max_budget_s:
            return False
        plan.extend(max(0.0, short))
    scratch.run([size], max_tokens=1)  # first use of the shape, untimed
    timed = [point for _ in range(repeats - 1)
             for point, _ in scratch.run([size], max_tokens=1)]
    steps = scratch.run([size], max_tokens=1 + DECODE_STEPS, deadline=plan.deadline)
    timed.append(steps[0][0])
    plan.prefills[size] = _median_point(timed)
    _keep_decodes(plan, 1, size, steps)
    return True


def _next_size_above_floor(plan: _Plan) -> int | None:
    """A prompt size to time between two timed ones, where the sizes timed show a launch floor
    (two or more ran as fast as the fastest, within FLOOR_TOLERANCE) but too few above it for
    a floor model to be scored on sizes it has not seen (monitor.step_model_choice holds one
    out at a time, and fits the terms on MIN_POINTS_ABOVE_FLOOR sizes above the floor at
    least); None where none is needed, or none is left between.

    On a GPU most of the ladder runs at the floor: an 8B model's steps on an H100 take the
    host's 30 ms up to some 900 tokens, and only 1024 and 2048 rose above it. No floor model
    could be scored on those, the line was kept (28.7 ms + 17 us a token, 72% off), and its
    error made every step's caps keep urgent turns out of each other's steps. The new size
    halves (geometrically) the widest gap between two sizes above the floor, or, with one
    above it, the gap between it and the largest at the floor."""
    if not plan.prefills:
        return None
    at_floor, above = _split_at_floor(plan)
    if len(at_floor) < 2 or not above or len(above) > MIN_POINTS_ABOVE_FLOOR:
        return None
    bounds = above if len(above) >= 2 else [at_floor[-1], *above]
    low, high = max(itertools.pairwise(bounds), key=lambda gap: gap[1] / gap[0])
    size = round(math.sqrt(low * high))
    return size if low < size < high else None


def _keep_decodes(plan: _Plan, batch: int, context: int,
                  steps: list[tuple[StepPoint, bool]]) -> None:
    decodes = [point for point, decode_only in steps if decode_only][1:]  # first use untimed
    if decodes:
        plan.decodes[(batch, context)] = _median_point(decodes)


def longest_decode_context(scratch: _Scratch, max_len: int) -> int:
    """The longest context a served decode can read: a sequence of max_model_len tokens, or
    all of the KV pool (one block spare), less the decodes timed over it."""
    block = scratch.scheduler.kv_cache_manager.block_size
    return min(max_len - 1, scratch.kv_tokens - block) - DECODE_STEPS


def _prefill_estimate(plan: _Plan, length: int, chunk: int) -> float:
    """A prompt of `length` prefilled in chunks of at most `chunk` tokens (the step budget)."""
    cost, prefix = 0.0, 0
    while prefix < length:
        n = min(chunk, length - prefix)
        cost += plan.estimate(n, n * (2 * prefix + n))
        prefix += n
    return cost


def _time_long_decode(scratch: _Scratch, plan: _Plan, step_tokens: int, max_len: int) -> None:
    """One decode over the longest context the budget left affords, up to the longest a
    served decode can read (halving from there): the decode term is then measured where
    serving uses it, not extrapolated from the short contexts the prompt ladder reached. The
    prompt is prefilled in chunks where it exceeds a step; the first decode is untimed."""
    timed = max((context for _, context in plan.decodes), default=0)
    context = longest_decode_context(scratch, max_len)
    while context >= LONG_DECODE_GAIN * max(timed, 1):
        cost = (_prefill_estimate(plan, context, step_tokens)
                + DECODE_STEPS * plan.estimate(1, 0, context))
        if cost <= plan.left_s:
            break
        context //= 2
    else:
        return
    scratch.set_chunk(step_tokens)
    try:
        steps = scratch.run([context], max_tokens=1 + DECODE_STEPS, deadline=plan.deadline)
    finally:
        scratch.set_chunk(0)
    _keep_decodes(plan, 1, context, steps)


def _time_decode_batch(scratch: _Scratch, plan: _Plan, max_seqs: int) -> None:
    """A wide batch of short contexts: what each decode costs besides the KV it reads."""
    batch, context = min(DECODE_BATCH, max_seqs), SMALLEST_PROMPT
    cost = (plan.estimate(batch * context, batch * context * context)
            + DECODE_STEPS * plan.estimate(batch, 0))
    kv_needed = batch * (context + DECODE_STEPS + scratch.scheduler.kv_cache_manager.block_size)
    if (batch < 2 or batch * context > plan.largest or kv_needed > scratch.kv_tokens
            or cost > plan.left_s):
        return
    _keep_decodes(plan, batch, context, scratch.run([context] * batch,
                                                    max_tokens=1 + DECODE_STEPS,
                                                    deadline=plan.deadline))


def _time_chunks(scratch: _Scratch, plan: _Plan, limit: int, max_len: int) -> None:
    """One prompt prefilled in chunks: the chunks over a prefix (from the third on, the first
    two being the shape's first use) show what attention over a prefix costs."""
    chunk = max([s for s in plan.prefills if 3 * s <= limit] or [min(plan.prefills)])
    count = 0
    for n in range(3, MAX_CHUNKS + 1):
        length = n * chunk
        cost = sum(plan.estimate(chunk, chunk * (2 * k * chunk + chunk)) for k in range(n))
        block = scratch.scheduler.kv_cache_manager.block_size
        if length + 1 > max_len or length + block > scratch.kv_tokens or cost > plan.left_s:
            break
        count = n
    if count < 3:
        return
    scratch.set_chunk(chunk)
    try:
        steps = scratch.run([count * chunk], max_tokens=1, deadline=plan.deadline)
    finally:
        scratch.set_chunk(0)
    if len(steps) > 2:
        # One point, the median chunk: a single slow step must not bend the attention term.
        plan.chunks = [_median_point([point for point, _ in steps[2:]])]


def startup_budget_s() -> float:
    value = os.environ.get(BUDGET_ENV)
    if value is None:
        return STARTUP_BUDGET_S
    try:
        return non_negative_float(value)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"{BUDGET_ENV} (seconds): {exc}") from None


def calibrate_at_startup(executor: Executor, config: EngineConfig, model: ResolvedModel,
                         budget_s: float | None = None) -> StartupCalibration | None:
    """Times steps on `executor` for about `budget_s` (default: startup_budget_s(); more on a
    machine too slow for it to time CONFIDENT_SIZES prompt sizes, see _time_prompts) and fits
    the step model on whatever it measured; None (logged) only where the limits leave no
    prompt size to time. A fit on fewer than CONFIDENT_SIZES sizes is unconfident
    (monitor.step_time_model.StepTimeModel.confident)."""
    budget_s = startup_budget_s() if budget_s is None else budget_s
    scratch = _Scratch(executor, config, model)
    sched = config.scheduler
    # A prompt and the tokens it decodes after its last timed run fit one step and the pool.
    limit = min(sched.max_num_batched_tokens, model.max_model_len - 1,
                scratch.kv_tokens - DECODE_STEPS - 1)
    if sched.long_prefill_token_threshold > 0:
        limit = min(limit, sched.long_prefill_token_threshold)
    plan = _Plan(budget_s)
    if limit >= 2:
        # The prompt sizes leave a share of the budget to one long-context decode, unless
        # the longest prompt already reaches the longest context a decode can read.
        reserve = (LONG_DECODE_SHARE * budget_s
                   if longest_decode_context(scratch, model.max_model_len) > limit else 0.0)
        _time_prompts(scratch, plan, limit, reserve)
    if not plan.prefills:
        logger.info("startup calibration: no prompt fits the limits (step budget, "
                    "max_model_len, KV pool); the predictor starts from its default and fits "
                    "online")
        return None
    if len(plan.prefills) < 2:
        # Kept, never thrown away: one size and its decodes still say more about this machine
        # than a default made for another.
        fitted = sparse_model(list(plan.prefills.values()), list(plan.decodes.values()))
        result = StartupCalibration(fitted, plan.points, {}, time.monotonic() - plan.started)
        logger.info("%s", describe(result, plan))
        return result
    _time_long_decode(scratch, plan, min(sched.max_num_batched_tokens, limit),
                      model.max_model_len)
    _time_decode_batch(scratch, plan, sched.max_num_seqs)
    _time_chunks(scratch, plan, limit, model.max_model_len)
    fitted, errors = choose_step_model(plan.points, config.slo_preemption.predictor_error_quantile)
    if fitted.seconds_per_token <= 0 or _floor_bound(plan):
        # Every size ran as fast (all at a launch floor: a simulated GPU's 30 ms with the
        # suite's short budget): no cost per token shows (a fit said -4e-7 s once, and
        # 1.7e-7 s another time, which let a document's chunk join an urgent turn's step
        # predicted at 30 ms that took 107 ms).
        fitted = sparse_model(list(plan.prefills.values()), [])
    elif len(plan.prefills) < CONFIDENT_SIZES:
        fitted = dataclasses.replace(fitted, confident=False)
    result = StartupCalibration(fitted, plan.points, errors, time.monotonic() - plan.started)
    logger.info("%s", describe(result, plan))
    return result


def describe(result: StartupCalibration, plan: _Plan) -> str:
    """The log line: what was measured, every candidate's held-out error, the fit kept."""
    m = result.model
    prompts = ", ".join(f"{n}: {p.seconds * 1e3:.1f}" for n, p in sorted(plan.prefills.items()))
    decodes = ", ".join(f"{b}x{c}: {p.seconds * 1e3:.1f}" for (b, c), p in plan.decodes.items())
    chunks = ", ".join(f"{p.tokens:.0f} tokens over {p.attention / p.tokens / 2 - p.tokens / 2:.0f}"
                       f": {p.seconds * 1e3:.1f}" for p in plan.chunks)
    errors = ", ".join(f"{name} " + ("n/a" if e is None else f"{e * 100:.1f}%")
                       for name, e in result.held_out_error.items())
    return (f"startup calibration ({result.seconds:.1f} s): prompt ms by tokens {{{prompts}}}; "
            f"decode ms by batch x context {{{decodes}}}; chunk ms [{chunks}]; held-out error: {errors}; fit: {m.seconds_per_token * 1e3:.4g} ms/token"
            f", {m.seconds_per_token_sq:.3g} s/attention, {m.seconds_per_decode_context:.3g} "
            f"s/decode-context token, intercept {m.intercept_s * 1e3:.1f} ms, floor "
            f"{m.floor_s * 1e3:.1f} ms, relative error {m.relative_error * 100:.0f}%"
            + ("" if m.confident else f"; unconfident ({len(plan.prefills)} prompt size(s) "
               f"timed): served steps refit it, and it writes no request off until they have"))
