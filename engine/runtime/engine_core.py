"""EngineCore: the busy loop schedule() -> execute -> update, over one scheduler and one executor.

With async scheduling (`SchedulerConfig.async_scheduling`, on an executor whose queued steps run
while the host goes on: engine.executor.base.Overlapping, a GPU or the simulation) a step that cannot be preempted is submitted and left in
flight: the next call schedules and submits the next step while the device runs it, and only
then reads it back (vLLM's async scheduling, SGLang's overlap scheduler). The next step can be
scheduled ahead only as a decode of the running requests (`Scheduler.can_schedule_ahead`), each
fed on the device by the token in flight; anything else (an arrival, a prefill, a request whose
sampling reads its history) first drains the pipeline, so a preemptible step never queues behind
another and an arrival waits at most for the steps already queued: the one running and one
behind it. Stop tokens and stop strings are then seen a step late, and the token computed ahead
is dropped: outputs are the same as the serial loop's.

EngineCore owns the engine's step-time predictor (monitor.predictor.StepTimePredictor) and hands
it to whoever reads it: the scheduler (its slack policy ranks and caps steps by it), the SLO
preemption control (each monitor snapshot carries its current model) and the load report. The
step loop feeds it: every completed step here, every unwound one through the SLO preemption
control.
"""

from __future__ import annotations

import itertools
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.executor.base import Executor, Overlapping, StepHandle
from engine.executor.factory import make_executor
from engine.processing.input_processor import validate_prompt
from engine.runtime.model_setup import ResolvedModel, check_pool_fits, resolve
from engine.outputs import EngineCoreOutput, SchedulerStats
from engine.core.long_rope import long_rope_threshold
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, StepStatus
from engine.load.load_report import ReplicaLoad
from engine.runtime.load_report import LoadTracker
from engine.runtime.slo_preemption import SLOPreemptionControl, snapshot_of_step
from engine.runtime.startup_calibration import (StartupCalibration, calibrate_at_startup,
                                                log_uncalibrated_start,
                                                wants_startup_calibration)
from engine.runtime.step_log import log_admitted, log_step
from engine.runtime.step_observation import observe_step
from engine.runtime.step_timing import StepObserver, StepTiming
from engine.structured_output.compiler import GrammarCompiler
from engine.structured_output.matcher import RequestGrammar
from monitor.predictor import StepTimePredictor
from monitor.step_time_model import StepTimeModel
from monitor.slo_preempt_signal import SLOPreemptSignal

if TYPE_CHECKING:
    import xgrammar


logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """A worker failed to run a step; carries the worker's error text."""


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None,
                 slo_preempt_signal: SLOPreemptSignal | None = None) -> None:
        """`slo_preempt_signal`: one another process owns, that this engine uses instead of creating
        its own (the API server's, which outlives an EngineCore process that dies)."""
        self.config = config
        self.model: ResolvedModel = resolve(config)
        slo_preemption = config.slo_preemption
        # A calibration file (--ttft-model) seeds the step-time predictor; without one, the
        # startup calibration below or else the pessimistic default does.
        seed = (StepTimeModel.load(slo_preemption.ttft_model) if slo_preemption.ttft_model
                else None)
        self.step_time_predictor = StepTimePredictor(
            seed, error_quantile=slo_preemption.predictor_error_quantile)
        signal = None
        if slo_preemption.enabled:
            signal = (slo_preempt_signal if slo_preempt_signal is not None
                      else SLOPreemptSignal.create())
        self.slo_preemption: SLOPreemptionControl | None = None
        self.startup_calibration: StartupCalibration | None = None
        started: Executor | None = None
        try:
            # A pool size the configuration fixes: the scheduler checks it before any weights
            # load. Otherwise the workers measure it on the GPU once they have loaded them.
            if self.model.num_blocks is not None:
                self._start_scheduling(signal)
            started = (executor if executor is not None
                       else make_executor(config, self.model, signal))
            if signal is not None and slo_preempt_signal is None:
                # Its own signal, and every worker rank that reads it has attached (they do
                # before the executor returns): its name can go (monitor/slo_preempt_signal.py).
                signal.unlink()
            if self.model.num_blocks is None:
                self.model.num_blocks = started.num_kv_blocks
                check_pool_fits(self.model, config, measured=True)
                self._start_scheduling(signal)
            if seed is None and wants_startup_calibration(config):
                # The predictor holds the default seed: swap in the machine's own, before any
                # request.
                self.startup_calibration = calibrate_at_startup(started, config, self.model)
                if self.startup_calibration is not None:
                    self.step_time_predictor.reseed(self.startup_calibration.model,
                                                    self.startup_calibration.points)
            elif seed is None and not config.slo_preemption.startup_calibration:
                log_uncalibrated_start()
        except BaseException:
            if self.slo_preemption is not None:
                self.slo_preemption.shutdown()  # closes the signal
            elif signal is not None:
                signal.close()
            if started is not None:
                started.shutdown()
            raise
        self.executor: Executor = started
        self.dead: str | None = None
        # Async scheduling: the step submitted and not yet read back (None: the loop is serial).
        self._overlap = (config.scheduler.async_scheduling and isinstance(started, Overlapping)
                         and started.overlaps_host)
        if config.scheduler.async_scheduling and not self._overlap:
            logger.warning("async scheduling is off: the %s runs one step at a time (a CPU "
                           "computes a step as it is launched; tensor-parallel workers read "
                           "their tokens back every step)", type(started).__name__)
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None
        # Requests handed over by other threads (submit_request), with their arrival number.
        self._inbox: queue.SimpleQueue[tuple[int, Request]] = queue.SimpleQueue()
        # (request id, when) of first visible outputs the consumer reported (note_first_output).
        self._first_outputs: queue.SimpleQueue[tuple[str, float]] = queue.SimpleQueue()
        self._arrival_seq = itertools.count(1)
        self._drained_arrivals = 0
        # (request id, error) for handed-over requests the scheduler refused; and those whose
        # grammar failed to compile, from the grammar thread.
        self.rejected: list[tuple[str, str]] = []
        self._rejected_async: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        # Structured outputs: grammars compile on a thread of their own. The vocabulary's
        # description is built by the first that needs it, or ahead of any by `prepare` (the
        # API server's engine process does, before it reports ready).
        self.grammars = GrammarCompiler(config.model.tokenizer or self.model.model_dir,
                                        self.vocab_size)
        # Requests handed over whose grammar is compiling: id -> request (an abort drops it).
        self._compiling: dict[str, Request] = {}
        self._compiling_lock = threading.Lock()
        self._hand_over_lock = threading.Lock()
        # Called (from the grammar thread) when a compiled request was handed to the loop or
        # refused: the host's loop may be asleep waiting for work (engine.ipc.core_process).
        self.wake: Callable[[], None] = lambda: None
        # Called with each step's StepTiming as `step` returns (engine/runtime/step_timing.py):
        # how benchmarks time steps. Empty, a step reads no clock for them.
        self.step_observers: list[StepObserver] = []

    @property
    def schedules_ahead(self) -> bool:
        """Whether async scheduling is in effect (asked for, on an executor whose queued steps
        run while the host goes on)."""
        return self._overlap

    def _start_scheduling(self, signal: SLOPreemptSignal | None) -> None:
        config, model = self.config, self.model
        assert model.num_blocks is not None
        predictor = self.step_time_predictor
        self.scheduler = Scheduler(config.scheduler, config.cache, model.num_blocks,
                                   model.max_model_len, config.slo_preemption, predictor,
                                   long_rope_after=long_rope_threshold(model.hf_config),
                                   kv_groups=model.kv_groups)
        if signal is not None:
            self.slo_preemption = SLOPreemptionControl(config.slo_preemption, self.scheduler,
                                                       predictor,
                                                       model.hf_config.num_hidden_layers, signal)
            # The monitor and the request reader must get the GIL within a fraction of a layer,
            # not after CPython's default 5 ms switch interval.
            sys.setswitchinterval(0.0005)
        self.load = LoadTracker(config, self.scheduler, predictor, signal)

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.model.hf_config.vocab_size

    def validate_request(self, request: Request) -> None:
        """Raises ValueError naming what is wrong with the prompt; changes nothing."""
        validate_prompt(request.prompt_token_ids, self.max_model_len, self.vocab_size)

    def add_request(self, request: Request) -> None:
        """From the engine loop's own thread, between steps. A grammar (structured outputs)
        compiles here and now: ValueError if it cannot."""
        self.validate_request(request)
        structured = request.sampling_params.structured_outputs
        if structured is not None and request.grammar is None:
            self._attach_grammar(request, self.grammars.compile(structured))
        request.max_model_len = self.max_model_len
        self.scheduler.add_request(request)

    def submit_request(self, request: Request) -> None:
        """From any thread, also while a step runs: validates at once (ValueError), shows the
        request to the monitor at once, and hands it to the engine loop for the next step.
        A request with structured outputs is handed over once its grammar has compiled, on the
        grammar thread (not scheduled, not shown to the monitor meanwhile: its deadline pays
        the compile time); one whose grammar fails is refused (`take_rejected`)."""
        self.validate_request(request)
        structured = request.sampling_params.structured_outputs
        if structured is None:
            self._hand_over(request)
            return
        with self._compiling_lock:
            self._compiling[request.request_id] = request

        def compiled(grammar: xgrammar.CompiledGrammar | None, error: str | None) -> None:
            with self._compiling_lock:
                if self._compiling.pop(request.request_id, None) is None:
                    return  # aborted while it compiled
            if grammar is None:
                self._rejected_async.put((request.request_id, error or "structured outputs"))
            else:
                self._attach_grammar(request, grammar)
                try:
                    self._hand_over(request)
                except ValueError as exc:
                    self._rejected_async.put((request.request_id, str(exc)))
            self.wake()

        self.grammars.then(structured, compiled)

    def _attach_grammar(self, request: Request, compiled: xgrammar.CompiledGrammar) -> None:
        stop_ids = list(request.sampling_params.stop_token_ids)
        if request.eos_token_id is not None:
            stop_ids.append(request.eos_token_id)
        request.grammar = RequestGrammar(compiled, stop_ids, self.vocab_size)

    def _hand_over(self, request: Request) -> None:
        # From the reader thread and the grammar thread: one at a time, so that arrival
        # numbers reach the inbox in order.
        with self._hand_over_lock:
            self._hand_over_locked(request)

    def _hand_over_locked(self, request: Request) -> None:
        # What its prefill skips, for the monitor's view of the arrival: a lookup of committed
        # blocks from this thread while a step may run (the engine loop commits between steps;
        # a lookup that misses a block committed meanwhile only underestimates the hit, and
        # add_request looks again in the loop's thread).
        self.scheduler.note_cached_prefix(request)
        seq = next(self._arrival_seq)
        self.load.note_arrival(seq, request)  # before the hand-over: never drained unseen
        self._inbox.put((seq, request))
        # A parallel sample waits on its leader's prefill (SiblingGate): stopping a step for
        # it could only delay the prefill it waits on.
        if self.slo_preemption is not None and request.prefill_after is None:
            self.slo_preemption.note_arrival(seq, request)

    def note_first_output(self, request_id: str, delivered_at: float) -> None:
        """From any thread: the request's first visible output reached its client at
        ``delivered_at`` (time.monotonic()). For requests with ``reports_first_output``: until
        this arrives their TTFT deadline stays live (docs/design.md section 9). Unknown or
        finished requests are ignored (the note may overtake an abort)."""
        self._first_outputs.put((request_id, delivered_at))

    def _drain_first_outputs(self) -> None:
        while True:
            try:
                request_id, delivered_at = self._first_outputs.get_nowait()
            except queue.Empty:
                return
            request = self.scheduler.get_request(request_id)
            if request is not None and request.first_output_time is None:
                request.first_output_time = delivered_at

    def _drain_inbox(self) -> None:
        self._drain_first_outputs()
        while True:
            try:
                seq, request = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                self.add_request(request)
            except ValueError as exc:
                self.rejected.append((request.request_id, str(exc)))
            else:
                log_admitted(request.request_id, len(request.prompt_token_ids),
                             request.ttft_slo_ms, time.monotonic() - request.arrival_time)
            self._drained_arrivals = seq

    def take_rejected(self) -> list[tuple[str, str]]:
        rejected, self.rejected = self.rejected, []
        while True:
            try:
                rejected.append(self._rejected_async.get_nowait())
            except queue.Empty:
                return rejected

    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self._drain_inbox()  # an abort may overtake its request's hand-over
        with self._compiling_lock:  # or its grammar's compilation
            for request_id in request_ids:
                self._compiling.pop(request_id, None)
        self.scheduler.abort_requests(list(request_ids), status)
        if not self.scheduler.has_unfinished_requests() and self._in_flight is None:
            self._deliver_pending_frees()  # no later step will carry them
            self.load.publish_idle(self._drained_arrivals)

    def has_unfinished_requests(self) -> bool:
        """Whether `step` has work: requests to run, or a step in flight to read back."""
        return (self.scheduler.has_unfinished_requests() or not self._inbox.empty()
                or self._in_flight is not None)

    def step(self) -> list[EngineCoreOutput]:
        """Run one engine step; returns the requests that got a new token this step. Each
        observer in `step_observers` gets the step's StepTiming once it returned."""
        if not self.step_observers:
            return self._step(None)
        timing = StepTiming(started=time.perf_counter())
        outputs = self._step(timing)
        timing.ended = time.perf_counter()
        for observer in self.step_observers:
            observer(timing)
        return outputs

    def _step(self, timing: StepTiming | None) -> list[EngineCoreOutput]:
        if self.dead is not None:
            raise EngineStepError(f"the engine stopped after a worker failure:\n{self.dead}")
        self._drain_inbox()
        outputs: list[EngineCoreOutput] = []
        if self._in_flight is not None and not self.scheduler.can_schedule_ahead():
            # What comes next depends on the tokens in flight (or must not queue behind them).
            outputs = self._complete_in_flight()
        if not self.scheduler.has_unfinished_requests():
            self._deliver_pending_frees()
            self.load.publish_idle(self._drained_arrivals)
            return outputs
        scheduler_output = self.scheduler.schedule()
        snapshot = snapshot_of_step(self.scheduler, scheduler_output,
                                    self.step_time_predictor.current, self._drained_arrivals,
                                    self.model.hf_config.num_hidden_layers)
        self.load.publish(snapshot)
        if self.slo_preemption is not None:
            self.slo_preemption.after_schedule(scheduler_output, self._drained_arrivals,
                                               snapshot)
        if scheduler_output.is_empty:
            if self._in_flight is not None:
                outputs += self._complete_in_flight()
            self._deliver_frees(scheduler_output)
            # Nothing ran and nothing changed: the same empty step would repeat forever. That
            # is one request's problem (it cannot be admitted), never the engine's.
            return outputs + [_core_output(r) for r in self.scheduler.fail_stalled()]
        if self._overlap and not scheduler_output.preemptible:
            return outputs + self._submit(scheduler_output, timing)
        assert self._in_flight is None, "a preemptible step was scheduled ahead"
        try:
            runner_output = self._execute(scheduler_output, timing)
        finally:
            self.load.step_ended(scheduler_output.step_id)
        return outputs + self._commit(scheduler_output, runner_output)

    def _submit(self, scheduler_output: SchedulerOutput,
                timing: StepTiming | None) -> list[EngineCoreOutput]:
        """Queue the step, then read back the one before it (if any): the host's work for the
        next step overlaps this one's on the device."""
        started = time.perf_counter() if timing is not None else 0.0
        assert isinstance(self.executor, Overlapping)
        handle = self.executor.submit_model(scheduler_output)
        outputs = self._complete_in_flight() if self._in_flight is not None else []
        self._in_flight = (scheduler_output, handle)
        if timing is not None:
            timing.scheduled = scheduler_output
            timing.execute_seconds = time.perf_counter() - started
        return outputs

    def _complete_in_flight(self) -> list[EngineCoreOutput]:
        assert self._in_flight is not None
        scheduler_output, handle = self._in_flight
        self._in_flight = None
        try:
            runner_output = handle.result()
        finally:
            self.load.step_ended(scheduler_output.step_id)
        return self._commit(scheduler_output, runner_output)

    def _commit(self, scheduler_output: SchedulerOutput,
                runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """What a step that came back does: a preempted one is rolled back, a failed one stops
        the engine, a completed one is committed."""
        log_step(scheduler_output, runner_output)
        if runner_output.status is StepStatus.SLO_PREEMPTED and self.slo_preemption is not None:
            self.slo_preemption.on_preempted(scheduler_output, runner_output)
            return []
        if runner_output.status is not StepStatus.OK:
            # The group's collectives are out of step after a failure: shut it down rather than
            # risk a hang, and refuse further work.
            self.dead = f"step {scheduler_output.step_id} failed on a worker:\n{runner_output.error}"
            self.executor.shutdown()
            raise EngineStepError(self.dead)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._observe_step_time(scheduler_output, runner_output)
        if not self.scheduler.has_unfinished_requests():
            self.load.publish_idle(self._drained_arrivals)
        return [_core_output(r) for r in updated]

    def _execute(self, scheduler_output: SchedulerOutput,
                 timing: StepTiming | None) -> ModelRunnerOutput:
        if timing is None:
            return self.executor.execute_model(scheduler_output)
        timing.scheduled = scheduler_output
        started = time.perf_counter()
        runner_output = self.executor.execute_model(scheduler_output)
        timing.execute_seconds = time.perf_counter() - started
        timing.transport_seconds = runner_output.transport_seconds
        return runner_output

    def _deliver_frees(self, scheduler_output: SchedulerOutput) -> None:
        """Suspended chunks dropped while no forward pass runs must still reach the workers,
        or their activations stay allocated (GPU memory on CUDA), and so must the requests
        whose blocks were freed (the workers' copies of their block tables): a step with
        nothing to compute carries them."""
        if not scheduler_output.free_suspended and not scheduler_output.released_req_ids:
            return
        runner_output = self.executor.execute_model(scheduler_output)
        if runner_output.status is not StepStatus.OK:
            self.dead = (f"step {scheduler_output.step_id} (frees only) failed on a worker:\n"
                         f"{runner_output.error}")
            self.executor.shutdown()
            raise EngineStepError(self.dead)

    def _deliver_pending_frees(self) -> None:
        if self.dead is None and (self.scheduler.slack.suspensions.unneeded
                                  or self.scheduler.kv_cache_manager.released):
            self._deliver_frees(self.scheduler.schedule())

    def _observe_step_time(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> None:
        """Feed the online step model (prefill, decode and mixed steps alike; a chunk resuming
        a suspended pass counts only the layers it ran)."""
        observe_step(self.step_time_predictor, scheduler_output, runner_output,
                     self.model.hf_config.num_hidden_layers)

    def load_report(self) -> ReplicaLoad:
        """This replica's load now, for a fleet's router. Safe from any thread, also while the
        engine thread is inside a step: built only from what that thread publishes
        (engine/runtime/load_report.py)."""
        return self.load.report()

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        if self.slo_preemption is not None:
            p = self.slo_preemption.stats
            stats.slo_preempt_wasted_tokens = p.wasted_tokens
            stats.slo_preempt_wasted_layers = p.wasted_layers
            stats.slo_preempt_latencies_s = self.slo_preemption.take_latencies()
            stats.monitor_errors = self.slo_preemption.monitor.num_errors
        return stats

    def shutdown(self) -> None:
        if self._in_flight is not None and self.dead is None:
            self._in_flight[1].result()  # nothing may still run on the device as it is freed
            self._in_flight = None
        self.grammars.shutdown()
        if self.slo_preemption is not None:
            self.slo_preemption.shutdown()
            self.slo_preemption = None
        if self.dead is None:
            self.executor.shutdown()


def _core_output(request: Request) -> EngineCoreOutput:
    finished = request.is_finished
    # A request that failed this step got no token in it.
    failed = request.status is RequestStatus.FINISHED_ERROR
    first_token = request.num_output_tokens == 1 and not failed
    return EngineCoreOutput(
        req_id=request.request_id,
        new_token_ids=[] if failed else request.output_token_ids[-1:],
        finish_reason=request.status.finish_reason if finished else None,
        stop_reason=request.stop_reason if finished else None,
        error=request.error,
        num_preemptions=request.num_preemptions,
        num_kv_preemptions=request.num_kv_preemptions,
        num_slo_preemptions=request.num_slo_preemptions,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time,
        finish_time=request.finish_time,
        slack_at_admission_s=request.slack_at_admission_s,
        new_logprobs=None if failed else request.last_logprobs,
        # Complete once the first token exists; sent with it, once.
        prompt_logprobs=request.prompt_logprobs if first_token else None,
    )
