"""The EngineCore side of a replica's load report (engine.load.load_report.ReplicaLoad).

A fleet's router asks for a report while this engine may be inside a long forward pass, so a
report is built on the asking thread (the EngineCore process's reader thread) from state that
the engine thread only ever publishes, never changes in place:

- the step's `MonitorSnapshot` (engine.runtime.slo_preemption.snapshot_of_step), swapped in by
  one reference after every schedule(), with SLO preemption on or off;
- the views of requests handed over but not yet in the scheduler (by arrival number, as the
  monitor keeps them);
- the running step's progress: the layers the vote reported through the preempt signal, and
  the id of the last step whose forward pass returned;
- plain counters (free blocks) and the pool's map of recently cached short hashes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.load.load_report import MAX_REPORTED_PREFIX_HASHES, QueuedRequest, ReplicaLoad
from engine.load.prefix_hashes import short_hash
from monitor.arrivals import PendingArrivals
from monitor.monitor import MonitorSnapshot
from monitor.policy import RequestView, view_of
from monitor.predictor import StepTimePredictor
from monitor.slo_preempt_signal import SLOPreemptSignal
from monitor.step_progress import remaining_seconds


@dataclass(frozen=True)
class _Published:
    """What the engine thread published at its last schedule() (or when it went idle)."""

    snapshot: MonitorSnapshot
    # Running requests not prefilling in the step: past their prefill, decoding.
    num_decoding: int


class LoadTracker:
    def __init__(self, config: EngineConfig, scheduler: Scheduler,
                 predictor: StepTimePredictor, signal: SLOPreemptSignal | None) -> None:
        self.config = config
        self.scheduler = scheduler
        # The engine's step-time predictor (EngineCore owns it): a report carries its current
        # model, for the router to price this replica's queue with.
        self.predictor = predictor
        # Reports the preemptible steps' layer progress (the vote); None: SLO preemption off.
        self.signal = signal
        self._published: _Published | None = None
        # Arrival number -> view of requests handed over (submit_request) and not yet drained
        # into the scheduler: the router must see a request it has just sent here.
        self._arrivals = PendingArrivals()
        # The last step whose forward pass returned: a later snapshot's step is still running.
        self._finished_step = -1

    # ---- the engine thread ----------------------------------------------------------------

    def publish(self, snapshot: MonitorSnapshot) -> None:
        num_decoding = max(0, self.scheduler.num_running - len(snapshot.running))
        self._published = _Published(snapshot, num_decoding)
        # The arrivals the scheduler has taken: pruned here too, or an engine nobody asks
        # for reports would keep a view of every request it ever received.
        self._arrivals.pending(snapshot.drained_arrivals)

    def step_ended(self, step_id: int) -> None:
        self._finished_step = step_id

    def publish_idle(self, drained_arrivals: int) -> None:
        """Nothing left to run (the last requests finished or were aborted): without this the
        last busy step's queue would be reported for as long as the engine stays idle."""
        published = self._published
        if published is not None and not (published.snapshot.waiting or
                                          published.snapshot.running or published.num_decoding):
            return
        scheduler = self.scheduler
        self._finished_step = scheduler.step_id
        self._published = _Published(MonitorSnapshot(
            step_id=scheduler.step_id, preemptible=False, waiting=(), running=(),
            predictor=self.predictor.current, drained_arrivals=drained_arrivals,
            chunk_tokens=scheduler.slack.chunk_tokens), 0)

    # ---- any thread -------------------------------------------------------------------------

    def note_arrival(self, seq: int, request: Request) -> None:
        self._arrivals.note(seq, view_of(request))

    def report(self) -> ReplicaLoad:
        # Both clocks once: deadlines are monotonic in this process, the report's times are
        # relative to the wall-clock made_at that every process of a fleet shares.
        now, made_at = time.monotonic(), time.time()
        published = self._published
        scheduler = self.scheduler
        kv = scheduler.kv_cache_manager
        slo = self.config.slo_preemption
        snapshot = published.snapshot if published is not None else None
        drained = snapshot.drained_arrivals if snapshot is not None else 0
        waiting = [_queued(v, now) for v in snapshot.waiting] if snapshot is not None else []
        waiting += [_queued(v, now) for v in self._arrivals.pending(drained)]
        running = [_queued(v, now) for v in snapshot.running] if snapshot is not None else []
        num_decoding = published.num_decoding if published is not None else 0
        step_remaining = 0.0
        if snapshot is not None and snapshot.step_id > self._finished_step:
            step_remaining = self._step_remaining(snapshot, now)
        return ReplicaLoad(
            made_at=made_at,
            step_model=self.predictor.current,
            waiting=waiting,
            running=running,
            num_decoding=num_decoding,
            decode_context=snapshot.decode_context if snapshot is not None else 0,
            step_remaining_s=step_remaining,
            step_preemptible=(snapshot is not None and snapshot.preemptible
                              and step_remaining > 0 and self.signal is not None),
            slo_preemption=slo.enabled,
            preempt_margin=slo.margin,
            num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.pool.num_blocks,
            block_size=kv.block_size,
            max_num_batched_tokens=scheduler.config.max_num_batched_tokens,
            cached_prefix_hashes=[short_hash(h) for h in
                                  kv.pool.newest_hashes(MAX_REPORTED_PREFIX_HASHES)],
            num_requests=len(waiting) + len(running) + num_decoding,
        )

    def _step_remaining(self, snapshot: MonitorSnapshot, now: float) -> float:
        """As the monitor weighs it (SLOMonitor._step_remaining): a preemptible step's own
        measured pace once the vote has reported a layer; otherwise the prediction less the
        time the step has run."""
        if snapshot.preemptible and self.signal is not None and not self.signal.closed:
            done, reported_at = self.signal.progress(snapshot.step_id)
            if done > 0:
                return remaining_seconds(snapshot.predicted_layer_ends(), done, reported_at,
                                         snapshot.started_at)
        return max(0.0, snapshot.predicted_step_s - (now - snapshot.started_at))



def _queued(view: RequestView, now: float) -> QueuedRequest:
    return QueuedRequest(view.remaining_prefill_tokens,
                         None if view.deadline is None else view.deadline - now, view.slo_s)
