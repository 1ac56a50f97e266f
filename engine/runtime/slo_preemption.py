"""EngineCore's side of mid-forward-pass preemption (docs/design.md sections 4 and 5).

Owns the shared-memory signal and the monitor thread; after every `schedule()` it publishes the
monitor's snapshot, and when the workers unwind a step it rolls the step back and applies the
monitor's decision to the victim. The step-time predictor is EngineCore's, handed in: each
snapshot carries its current model to the monitor, and an unwound step's layers feed it.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

from engine.config import SLOPreemptionConfig, SLOPreemptMode
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.runtime.step_observation import observe_step
from monitor.monitor import MonitorSnapshot, SLOMonitor
from monitor.policy import RequestView, view_of
from monitor.predictor import StepTimePredictor
from monitor.slo_preempt_signal import SLOPreemptSignal
from monitor.step_progress import predicted_layer_ends
from monitor.step_time_model import StepTimeModel


@dataclass
class SLOPreemptionEvent:
    """One unwound step, as EngineCore saw it."""

    step_id: int
    layer: int
    # The layer every TP rank stopped at, rank order.
    unwound_layers: list[int]
    victim_id: str
    waiter_id: str
    # What really happened to the victim: "pause" / "suspend" (it kept its KV), "recompute"
    # (it lost it; also a victim the unwound step had admitted, which the rollback sent back
    # to the queue), or None when the victim was gone and the step just re-runs.
    applied: SLOPreemptMode | None
    # Monitor decision -> EngineCore holding the unwound step.
    latency_s: float
    wasted_tokens: int
    # time.monotonic() of both ends of that latency.
    decided_at: float = 0.0
    unwound_at: float = 0.0


@dataclass
class SLOPreemptionStats:
    wasted_tokens: int = 0
    wasted_layers: int = 0
    # Latencies not yet handed to a stats snapshot (the API server's histogram takes them).
    unreported_latencies_s: list[float] = field(default_factory=list)


class SLOPreemptionControl:
    def __init__(self, config: SLOPreemptionConfig, scheduler: Scheduler,
                 predictor: StepTimePredictor, num_layers: int,
                 signal: SLOPreemptSignal | None = None) -> None:
        """``predictor``: the engine's step-time predictor (EngineCore owns it), whose model
        the monitor decides by and which unwound steps feed. ``signal``: one created earlier
        (the workers attach to it as they start); this object owns it from now on and closes it
        at shutdown."""
        self.config = config
        self.scheduler = scheduler
        self.predictor = predictor
        self.num_layers = num_layers
        self.signal = signal if signal is not None else SLOPreemptSignal.create()
        self.monitor = SLOMonitor(self.signal, config.policy, config.margin,
                                  config.monitor_interval_ms / 1000,
                                  aging_bound_s=scheduler.slack.aging_bound_s)
        self.stats = SLOPreemptionStats()
        # The most recent unwinds, for tests, benchmarks and debugging (bounded: a server runs
        # for weeks).
        self.events: deque[SLOPreemptionEvent] = deque(maxlen=1024)
        self.monitor.start()

    def note_arrival(self, seq: int, request: Request) -> None:
        self.monitor.note_arrival(seq, view_of(request))

    def after_schedule(self, output: SchedulerOutput, drained_arrivals: int,
                       snapshot: MonitorSnapshot | None = None) -> None:
        """``snapshot``: the step's full snapshot (snapshot_of_step), when EngineCore already
        built one for its load report."""
        scheduler = self.scheduler
        slack = scheduler.slack
        if not output.preemptible:
            # The monitor never targets such a step: views of every request would be wasted
            # work on the step loop.
            self.monitor.publish(MonitorSnapshot(
                step_id=output.step_id, preemptible=False, waiting=(), running=(),
                predictor=self.predictor.current,
                drained_arrivals=drained_arrivals))
            return
        if snapshot is None:
            snapshot = snapshot_of_step(scheduler, output, self.predictor.current,
                                        drained_arrivals, self.num_layers)
        # Paused victims resume at a step boundary by the scheduler's own rule: not waiters
        # the monitor could stop a step for (the load report counts them: their prefill is
        # owed).
        waiting = tuple(v for v in snapshot.waiting if not slack.holds.is_held(v.request_id))
        if len(waiting) != len(snapshot.waiting):
            snapshot = dataclasses.replace(snapshot, waiting=waiting)
        self.monitor.publish(snapshot)

    def on_preempted(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        unwound_at = time.monotonic()
        target, victim_id, waiter_id, decided_at = self.signal.decision()
        scheduler = self.scheduler
        # The layers below the stop ran: what they took is a step point like any other.
        observe_step(self.predictor, output, runner_output, self.num_layers)
        layer = runner_output.slo_preempted_layer or 0
        applied, kept_tokens = unwind_step(scheduler, output, runner_output.suspended_req_ids,
                                           target, victim_id, waiter_id, layer)
        latency = max(0.0, unwound_at - decided_at)
        # Kept chunks lose nothing, and are scheduled (and counted) again when they resume:
        # count their tokens once.
        wasted = output.num_scheduled_tokens - kept_tokens
        scheduler.num_scheduled_tokens_total -= kept_tokens
        self.stats.wasted_tokens += wasted
        self.stats.wasted_layers += layer if wasted else 0
        self.stats.unreported_latencies_s.append(latency)
        self.events.append(SLOPreemptionEvent(output.step_id, layer, runner_output.unwound_layers,
                                           victim_id, waiter_id, applied, latency, wasted,
                                           decided_at, unwound_at))

    def take_latencies(self) -> list[float]:
        latencies, self.stats.unreported_latencies_s = self.stats.unreported_latencies_s, []
        return latencies

    def shutdown(self) -> None:
        self.monitor.stop()
        self.signal.close()


def snapshot_of_step(scheduler: Scheduler, output: SchedulerOutput, model: StepTimeModel,
                     drained_arrivals: int, num_layers: int) -> MonitorSnapshot:
    """The scheduler's state as the step it just scheduled leaves it: every waiting request
    (paused victims included), the requests prefilling in the step, and the step's predicted
    duration from now (time.monotonic()) by `model` (the step-time predictor's current one,
    which the snapshot carries to the monitor). Built once per step; the monitor reads it for
    its decisions, the load report (engine.runtime.load_report) from any thread.

    Layer boundaries only for a preemptible step, whose progress the vote reports layer by
    layer; another step's duration is one prediction, spread evenly."""
    slack = scheduler.slack
    waiting = tuple(view_of(r) for r in scheduler.waiting) if len(scheduler.waiting) else ()
    running: list[RequestView] = []
    # One pass over the step (a decode step of hundreds of requests runs this every few ms):
    # the prefill views and the step-time features together.
    tokens = attention = decodes = 0
    for sr in output.requests:
        n = len(sr.token_ids)
        tokens += n
        if n == 1:
            decodes += sr.start_pos + 1  # monitor.step_point.decode_context
            continue
        attention += n * (2 * sr.start_pos + n)  # monitor.step_point.attention_work
        request = scheduler.requests[sr.req_id]
        running.append(view_of(request, computed_tokens=sr.start_pos,
                               slo_preempted=slack.protected_by_rule1(request)))
    if output.preemptible:
        chunks = [(sr.start_pos, len(sr.token_ids), _join_layer(scheduler, sr))
                  for sr in output.requests]
        layer_ends = predicted_layer_ends(model.predict_step, chunks, num_layers)
        predicted = layer_ends[-1]
    else:
        layer_ends = ()
        predicted = model.predict_step(tokens, attention, decodes) if tokens else 0.0
    return MonitorSnapshot(
        step_id=output.step_id, preemptible=output.preemptible, waiting=waiting,
        running=tuple(running), predictor=model, drained_arrivals=drained_arrivals,
        started_at=time.monotonic(), predicted_step_s=predicted, decode_context=decodes,
        num_layers=num_layers, layer_ends=layer_ends, chunk_tokens=slack.chunk_tokens)


def _join_layer(scheduler: Scheduler, sr: ScheduledRequest) -> int:
    """The layer a chunk enters the pass at: a resumed one where its pass stopped."""
    held = scheduler.slack.suspensions.next_chunk(sr.req_id) if sr.resume else None
    return held.layer if held is not None else 0


def unwind_step(scheduler: Scheduler, output: SchedulerOutput, suspended_req_ids: list[str],
                target: int, victim_id: str, waiter_id: str, stopped_layer: int = 0
                ) -> tuple[SLOPreemptMode | None, int]:
    """The scheduler's side of a step the workers unwound before ``stopped_layer``: roll it
    back, apply the monitor's decision if it was for this step (``target``), and free what
    nobody resumes.

    Suspend mode: every prefill chunk of the step whose activations the workers kept
    (``suspended_req_ids``) keeps its blocks through the rollback and resumes at the stopped
    layer: none of them before the waiter has its first token (the waiter's step is its own),
    the victim's once it is also the most urgent again. Returns the mode applied to the victim
    and the tokens of the chunks kept.
    """
    record = scheduler.last_step_record
    assert record is not None and record.step_id == output.step_id
    suspended = set(suspended_req_ids)
    kept = [sr for sr in output.requests
            if sr.req_id in suspended and scheduler.is_running(sr.req_id)]
    scheduler.rollback(record, keep=kept, stopped_layer=stopped_layer)
    slack = scheduler.slack
    applied: SLOPreemptMode | None = None
    if target == output.step_id:
        applied = slack.preempt_for_slo(scheduler, victim_id, waiter_id,
                                        kept=[sr.req_id for sr in kept])
    ledger = slack.suspensions
    ledger.drop([i for i in suspended if not ledger.is_suspended(i)])
    kept_tokens = sum(len(sr.token_ids) for sr in kept if ledger.is_suspended(sr.req_id))
    return applied, kept_tokens
