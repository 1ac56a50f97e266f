"""Deadline caps of the slo policy: how many tokens a step may still take so that its predicted
time keeps the deadlines it serves (docs/design.md section 5).

A step lasts as long as all its tokens take, and every request in it gets its next token only
at its end. So, once the urgent admissions are in a step, what joins them is capped to keep the
step within each urgent request's TTFT deadline (`cap_for_deadlines`, `join_budget`); and
decodes with an inter-token objective (a TPOT objective, or the gap of an interactive turn)
cap the step's prefill so that it fits the tightest of their next-token deadlines
(`cap_for_tpot`: Sarathi's stall-free batching, driven by deadlines). Every cap leaves
DEADLINE_HEADROOM of the time unfilled and allows for the predictor's observed error.

The caps read the running decodes and the deepest running prefix as SlackPolicy.begin_step
fixed them for the step (`StepContext`), and the holds: a held request is not in the step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.core.preemption_holds import PreemptionHolds
from engine.core.request import Request
from engine.core.request_queue import RequestQueue
from engine.core.step_record import StepInProgress
from monitor.policy import DEADLINE_HEADROOM
from monitor.predictor import StepTimePredictor
from monitor.step_point import attention_work

# The share the running decodes may add to the predicted time of a step that already makes an
# urgent request late: below it they join (its lateness hardly changes, their streams go on).
DECODES_SHARE = 0.1


def is_tpot_decode(request: Request) -> bool:
    """A decoding request with an inter-token objective: a TPOT objective, or the gap of an
    interactive turn (a request a mid-forward preemption was made for, see `gap_objective`):
    its next token is due. (One recomputing its sequence after a KV preemption owes more than
    a token: it is prefilling.)"""
    return ((request.tpot_slo_ms is not None or request.served_urgently)
            and request.last_token_time is not None and request.num_tokens_owed <= 1)


# An interactive turn's next token is due within this many decode-only steps of its last one.
INTERACTIVE_GAP_STEPS = 2.0


def gap_objective(request: Request, decode_step_s: float) -> float:
    """Seconds its next token may take after its last one: its TPOT objective; a request a
    mid-forward preemption was made for streams as an interactive turn, within
    max(2 x its TPOT objective, 2 x a decode-only step) (docs/design.md section 9). Its TPOT
    objective alone is the tighter of the two where it has one, and is what binds."""
    if request.tpot_slo_ms is not None:
        return request.tpot_slo_ms / 1000
    return INTERACTIVE_GAP_STEPS * decode_step_s


class QueuedRequests(Protocol):
    """What the caps see of the scheduler (`Scheduler` is one)."""

    @property
    def waiting(self) -> RequestQueue: ...

    @property
    def running(self) -> list[Request]: ...


@dataclass
class StepContext:
    """What the step's predictions take as given, fixed as it starts (SlackPolicy.begin_step):
    the running decodes (every step until they finish carries them, so prefills are predicted
    beside the KV they read) and the deepest prefix a running prefill chunk attends over (what
    the caps charge the chunks that may join the urgent ones)."""

    # The running decodes that are not held, and the KV tokens they read.
    decodes: list[Request] = field(default_factory=list)
    decode_context: int = 0
    deepest_prefix: int = 0


class DeadlineCaps:
    """The slo policy's caps on a step's tokens, by the deadlines it serves."""

    def __init__(self, predictor: StepTimePredictor, context: StepContext,
                 holds: PreemptionHolds, predict_prefill: Callable[[int], float]) -> None:
        """`predictor`, `context` and `holds` are read, never changed: SlackPolicy owns the
        context and the holds, EngineCore the predictor. `predict_prefill`: seconds to prefill
        `tokens` in chunks of the step budget beside the running decodes
        (SlackPolicy.predict_prefill)."""
        self._predictor = predictor
        self._context = context
        self._holds = holds
        self._predict_prefill = predict_prefill

    def cap_for_deadlines(self, step: StepInProgress) -> int:
        """A step lasts as long as all its tokens take, and every request in it gets its first
        token only at its end. The step so far holds only the urgent admissions
        (SlackPolicy.admit_first); what joins them after (the running decodes, then other
        chunks, resumed suspended chunks first of all) may take only as many tokens (at most
        the step's budget left) as keep the predicted step within each urgent request's
        deadline. The chunks that may join are charged their attention over the deepest running
        prefix: a chunk over a 28k-token prefix costs several fresh prompts of its size.

        An urgent request that its own chunk alone would make late is made as little late as
        possible: nothing joins it."""
        # The running decodes join the step after these admissions: they count now.
        pending_decodes = [r for r in self._context.decodes if r.request_id not in step]
        return self._deadline_cap(step, self._context.deepest_prefix, pending_decodes,
                                  late_blocks=True)

    def join_budget(self, step: StepInProgress, request: Request) -> int:
        """The tokens `request` (a running chunk or a waiting admission) may add to `step`: no
        more than keep the predicted step within the deadline of every request it already gives
        a first token to (one whose chunk alone is late constrains nothing here: only the turns
        a preemption or an outranking admission put first are served alone). So an urgent turn
        admitted beside a long document is not made to wait for the document's whole prefill:
        the document joins with the chunk that fits."""
        return self._deadline_cap(step, request.num_computed_tokens, (), late_blocks=False,
                                  joiner=request)

    def _deadline_cap(self, step: StepInProgress, joining_prefix: int,
                      pending_decodes: Sequence[Request], late_blocks: bool,
                      joiner: Request | None = None) -> int:
        if not step.with_deadline:
            return step.budget
        now = time.monotonic()
        line = self._predictor.current
        tokens = step.num_tokens + len(pending_decodes)
        attention = step.attention
        context = step.decode_context + sum(r.num_tokens for r in pending_decodes)
        allowed = step.budget
        for request in step.with_deadline.values():
            assert request.deadline is not None
            num_new = step.scheduled[request.request_id][1]
            time_left = request.deadline - now
            alone = line.predict_step(num_new, attention_work([(request.num_computed_tokens,
                                                                num_new)]))
            usable = self._usable(time_left)
            with_decodes = line.predict_step(tokens, attention, context)
            if alone > time_left or (late_blocks and with_decodes > usable):
                if not late_blocks:
                    if joiner is not None and self._can_wait_for(joiner, alone, now):
                        # Late whatever joins it, so late as little as can be: a joiner
                        # whose own deadline allows a step of it waits for the next one
                        # (before, a document's 1908 suspended tokens joined a late
                        # 138-token turn's step, and its first token waited 3.3 s), all
                        # but what the step takes for free (below).
                        return line.max_chunk_within(with_decodes, tokens, attention, context,
                                                     joining_prefix)
                    continue  # nothing left to protect from those that cannot wait
                # Late whatever joins it, or the running decodes alone would make it late:
                # nothing joins that lengthens the step, so it is as little late as can be;
                # the running decodes join where they cost the step little (a GPU's step is
                # floor-bound: a few decodes are free there, and without them every stream
                # stalls a step), and then what else the step takes for free.
                decodes_cost = with_decodes / line.predict_step(step.num_tokens, attention,
                                                                step.decode_context)
                if decodes_cost > 1 + DECODES_SHARE:
                    return 0
                return len(pending_decodes) + line.max_chunk_within(
                    with_decodes, tokens, attention, context, joining_prefix)
            # Within the share of its time a cap may fill, or, where the step already fills
            # more (the turn still makes it), only what the step takes for free: a floor-bound
            # step (a GPU's lasts its floor up to some hundreds of tokens) is no longer for
            # what fits under the floor, and holding that out protected nothing (a 448-token
            # turn beside a tight 208-token one on the simulated H100 waited a decode-only
            # step more for a step of its own). Elsewhere that is nothing: before, a
            # 1355-token document joined a 53-token turn with 150 ms left, and both waited
            # 1.8 s.
            joining = line.max_chunk_within(max(usable, with_decodes), tokens, attention,
                                            context, joining_prefix)
            allowed = min(allowed, len(pending_decodes) + joining)
        return allowed

    def tpot_decodes(self, requests: QueuedRequests, step: StepInProgress) -> list[Request]:
        """The running decodes with an inter-token objective that `step` does not serve yet
        (and that are not held)."""
        return [r for r in requests.running if is_tpot_decode(r) and r.request_id not in step
                and not self._holds.is_held(r.request_id)]

    def cap_for_tpot(self, requests: QueuedRequests, step: StepInProgress) -> int:
        """The tokens the step may still schedule (its TPOT decodes' own included)
        so that its predicted time fits every TPOT decode's next-token deadline (the latest
        token's time plus its objective) that a step of just the decodes can still meet; a
        deadline it cannot constrains nothing, so prefill never stalls behind an objective no
        step could meet. Like the TTFT cap, it leaves DEADLINE_HEADROOM of the time unfilled and
        allows for the predictor's observed error."""
        decodes = self.tpot_decodes(requests, step)
        if not decodes:
            return step.budget
        now = time.monotonic()
        line = self._predictor.current
        context = self._context.decode_context
        minimal = step.num_tokens + len(decodes)
        decode_step = line.predict(len(decodes), context)
        allowed = step.budget
        # Interactive turns only: the tokens their gaps allow (enforced unless that pace would
        # make a prefill with a deadline miss it, or a late one later than it stalls them:
        # _pace_must_yield).
        interactive_allowed, interactive_gap, interactive_steps = step.budget, 0.0, 0
        num_interactive = 0
        for request in decodes:
            assert request.last_token_time is not None
            gap = gap_objective(request, decode_step)
            time_left = request.last_token_time + gap - now
            if decode_step > time_left:
                continue  # missed even by a step of the decodes alone: nothing to protect
            # The chunks that may join are charged their attention over the deepest running
            # prefix, as the TTFT cap does: a piece of a suspended 24k-token document is
            # not priced as a fresh prompt. Where the step already overruns the gap (an urgent
            # turn's prefill went first), nothing more joins: it overruns as little as can be.
            # What the step takes for free (a floor-bound step lasts its floor however
            # little it holds) never lengthens a gap, so it joins even where it overruns.
            usable = max(self._usable(time_left),
                         line.predict_step(minimal, step.attention, context))
            fits = len(decodes) + line.max_chunk_within(usable, minimal, step.attention,
                                                        context, self._context.deepest_prefix)
            if request.tpot_slo_ms is None:
                num_interactive += 1
                interactive_allowed = min(interactive_allowed, fits)
                interactive_gap = max(interactive_gap, gap)
                interactive_steps = max(interactive_steps, request.sampling_params.max_tokens
                                        - request.num_output_tokens)
            else:
                allowed = min(allowed, fits)
        if interactive_allowed < allowed and not self._pace_must_yield(
                requests, step, interactive_allowed - len(decodes), interactive_gap,
                interactive_steps, num_interactive, now):
            allowed = interactive_allowed
        return allowed

    def _pace_must_yield(self, requests: QueuedRequests, step: StepInProgress,
                         prefill_per_step: int, step_s: float, num_steps: int,
                         num_streams: int, now: float) -> bool:
        """Whether the interactive turns' pace (for the next `num_steps` steps, their tokens
        left, only `prefill_per_step` prefill tokens join a step of `step_s`) costs a request
        with prefill left and a live deadline (running or waiting, not held, not served by
        `step` already) more than it protects:

        - its deadline: it would meet it at full speed, and miss it at the pace;
        - or, already late at full speed, more lateness than its prefill would stall the
          `num_streams` streams (each once, by about its prefill): late as little as possible.
          Before, such a request waited for every turn's last token: beside two busy
          processes, two turns of a burst the deadline cap had kept out of the first turn's
          step waited 1.8 s more behind the decodes of the turns served before them."""
        per_step = max(1, prefill_per_step)
        for request in (*requests.running, *requests.waiting):
            deadline = request.live_deadline
            owed = request.num_tokens_owed
            if (deadline is None or owed <= 1 or self._holds.is_held(request.request_id)
                    or request.request_id in step):
                continue
            if owed <= per_step * num_steps:
                paced = math.ceil(owed / per_step) * step_s
            else:  # at full speed once the turns are done
                paced = num_steps * step_s + self._predict_prefill(owed - per_step * num_steps)
            full_speed = self._predict_prefill(owed)
            if full_speed <= deadline - now:
                # Judged with the caps' margins (DEADLINE_HEADROOM, the predictor's error): a
                # relaxed document must not find out at its deadline that the turns took its
                # time.
                if paced > self._usable(deadline - now):
                    return True
            elif paced - full_speed > num_streams * full_speed:
                return True
        return False

    def _can_wait_for(self, request: Request, step_s: float, now: float) -> bool:
        """Whether `request` still meets its deadline if it waits for a step of `step_s`
        first, judged with the caps' margins. A request without a deadline (or past its first
        token) is not kept waiting here: nothing would age it, and nothing says when it may
        run."""
        deadline = request.live_deadline
        if deadline is None:
            return False
        wait = step_s + self._predict_prefill(request.num_tokens_owed)
        return wait <= self._usable(deadline - now)

    def _usable(self, time_left: float) -> float:
        """The part of `time_left` a cap may fill: DEADLINE_HEADROOM stays free, and the rest
        is shrunk by how far off the predictor has been running (its two-sided
        relative_error)."""
        return time_left * (1 - DEADLINE_HEADROOM) / (1 + self._predictor.current.relative_error)
