"""The slack-EDF monitor thread (docs/design.md section 5).

EngineCore publishes an immutable `MonitorSnapshot` after every `schedule()` by swapping one
reference; whoever receives requests tells the monitor about each arrival at once, since a new
request only reaches the scheduler after the running step. The monitor wakes on arrivals and on
every preemptible step, polls every `interval_s` while that step runs and a waiter with a
deadline could call for it, and when the gate fires
writes the executing step's id into the shared-memory signal, which the workers read at the
next attention-op boundary.

It takes no lock the main thread waits on: reading the snapshot and the arrivals is a reference
read, and the only thing it writes is the signal.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from monitor.policy import SLOPreemptDecision, SLOPreemptPolicy, RequestView, choose_slo_preemption
from monitor.arrivals import PendingArrivals
from monitor.step_time_model import StepTimeModel, optimistic_prefill, predict_prefill
from monitor.slo_preempt_signal import SLOPreemptSignal
from monitor.step_progress import remaining_seconds

logger = logging.getLogger(__name__)

# Decisions kept for tests, benchmarks and debugging: a server runs for weeks.
DECISION_HISTORY = 1024
# An error that repeats on every poll is logged at most this often (it is counted every time).
ERROR_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class MonitorSnapshot:
    """The scheduler's state as the executing step left it."""

    step_id: int
    # Only preemptible steps vote; targeting any other step would be a wasted decision.
    preemptible: bool
    # Requests that are waiting for admission (paused victims are not: they resume at a step
    # boundary by the scheduler's own rule).
    waiting: tuple[RequestView, ...]
    # Requests prefilling in this step: the ones whose work holds the waiters back. Their
    # remaining tokens count this step's chunk, which a preemption would throw away.
    running: tuple[RequestView, ...]
    predictor: StepTimeModel
    # Arrivals with a sequence number up to this one are in the scheduler (or were rejected).
    drained_arrivals: int = 0
    # When the step was handed to the workers (time.monotonic()) and its predicted duration:
    # how much of it is left.
    started_at: float = 0.0
    predicted_step_s: float = 0.0
    # KV tokens the step's decodes read: the next steps carry much the same decodes, so a
    # waiter's prefill is predicted beside them.
    decode_context: int = 0
    # Decoder layers of the model: with the layers done (reported through the signal), the
    # step's own pace predicts its remaining time better than the predictor does.
    num_layers: int = 0
    # Predicted seconds from started_at to each layer boundary (monitor.step_progress); empty:
    # predicted_step_s spread evenly over num_layers.
    layer_ends: tuple[float, ...] = ()
    # The step budget: a waiting prompt longer than it is prefilled in chunks of it, each a
    # step (monitor.step_time_model.predict_prefill); 0: priced as one step.
    chunk_tokens: int = 0

    def predicted_layer_ends(self) -> tuple[float, ...]:
        if self.layer_ends:
            return self.layer_ends
        layers = max(1, self.num_layers)
        return tuple(self.predicted_step_s * layer / layers for layer in range(layers + 1))


@dataclass(frozen=True)
class MonitorDecision:
    step_id: int
    decision: SLOPreemptDecision
    decided_at: float


class SLOMonitor:
    def __init__(self, signal: SLOPreemptSignal, policy: SLOPreemptPolicy = "conservative",
                 margin: float = 1.2, interval_s: float = 0.002,
                 aging_bound_s: float | None = None) -> None:
        self.signal = signal
        self.aging_bound_s = aging_bound_s
        self.policy: SLOPreemptPolicy = policy
        self.margin = margin
        self.interval_s = interval_s
        self._snapshot: MonitorSnapshot | None = None
        # Arrival sequence number -> view; written by the thread that receives requests.
        self._arrivals = PendingArrivals()
        self._wake = threading.Event()
        self._stopped = False
        self._fired_step = -1
        self.decisions: deque[MonitorDecision] = deque(maxlen=DECISION_HISTORY)
        # Exceptions the thread survived (a metric): a dead monitor would turn preemption off
        # without a word.
        self.num_errors = 0
        self._last_error_logged = -float("inf")
        self._thread = threading.Thread(target=self._run, name="sloserve-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)

    # ---- called by other threads (never block) -------------------------------------------

    def publish(self, snapshot: MonitorSnapshot) -> None:
        """A preemptible step wakes the monitor, which then polls until it ends; a snapshot is
        taken after every schedule(), so finishes and admissions are in it. Other steps are
        never targeted: no need to look."""
        self._snapshot = snapshot
        if snapshot.preemptible:
            self._wake.set()

    def note_arrival(self, seq: int, view: RequestView) -> None:
        self._arrivals.note(seq, view)
        self._wake.set()

    # ---- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            # Poll only while a preemptible step runs that has not been targeted yet and a
            # waiter with a deadline exists (only such a waiter can call for a preemption);
            # otherwise sleep until the next snapshot or arrival: an idle engine, or one
            # serving no deadlines, spends no CPU on the monitor.
            snapshot = self._snapshot
            watching = (snapshot is not None and snapshot.preemptible
                        and snapshot.step_id > self._fired_step
                        and self._deadline_waiting(snapshot))
            self._wake.wait(self.interval_s if watching else None)
            self._wake.clear()
            try:
                self.check()
            except Exception:
                self._note_error()

    def _deadline_waiting(self, snapshot: MonitorSnapshot) -> bool:
        return (any(w.deadline is not None for w in snapshot.waiting)
                or self._arrivals.any_with_deadline())

    def _note_error(self) -> None:
        self.num_errors += 1
        now = time.monotonic()
        if now - self._last_error_logged >= ERROR_LOG_INTERVAL_S:
            self._last_error_logged = now
            logger.exception("SLO monitor: check failed (%d errors so far); the monitor keeps "
                             "running", self.num_errors)

    def _step_remaining(self, snapshot: MonitorSnapshot) -> float:
        done, reported_at = self.signal.progress(snapshot.step_id)
        return remaining_seconds(snapshot.predicted_layer_ends(), done, reported_at,
                                 snapshot.started_at)

    def check(self) -> MonitorDecision | None:
        """One evaluation of the gate against the current snapshot; publishes a decision."""
        snapshot = self._snapshot
        if snapshot is None:
            return None
        # Pruned on every wake, targetable step or not: with only short prompts no step is
        # preemptible, and the arrivals the scheduler has taken must not pile up.
        arrivals = tuple(self._arrivals.pending(snapshot.drained_arrivals))
        if not snapshot.preemptible or snapshot.step_id <= self._fired_step:
            return None
        now = time.monotonic()
        step_remaining = self._step_remaining(snapshot)
        predictor, decodes = snapshot.predictor, snapshot.decode_context
        chunk = snapshot.chunk_tokens
        decision = choose_slo_preemption(snapshot.waiting + arrivals, snapshot.running, now,
                                     lambda tokens: predict_prefill(predictor, tokens, decodes,
                                                                    chunk),
                                     self.policy, self.margin,
                                     step_remaining_s=step_remaining,
                                     relative_error=snapshot.predictor.relative_error,
                                     aging_bound_s=self.aging_bound_s,
                                     optimistic=lambda tokens: optimistic_prefill(
                                         predictor, tokens, decodes, chunk))
        if decision is None:
            return None
        self._fired_step = snapshot.step_id
        decided_at = time.monotonic()
        self.signal.publish(snapshot.step_id, decision.victim_id, decision.waiter_id, decided_at)
        made = MonitorDecision(snapshot.step_id, decision, decided_at)
        logger.debug("stop step %d for %s (victim %s): its predicted time left %.1f ms",
                     snapshot.step_id, decision.waiter_id, decision.victim_id,
                     1000 * step_remaining)
        self.decisions.append(made)
        return made

