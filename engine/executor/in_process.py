"""The in-process executor: TP=1, one worker (rank 0, in no process group) in EngineCore's own
process, started by the same sequence as every other rank (workers.worker.Worker.start).

It can queue steps (engine.executor.base.Overlapping): ``submit_model`` launches the step on the
device and returns its handle, which reads the step back when asked (workers.model_runner:
``ModelRunner.launch``). Only a GPU runs the step while the host goes on: on a CPU the launch
computes it (``overlaps_host`` is False, and EngineCore keeps its serial loop). A second thread
computing the steps was measured slower there: 39.9 ms a decode step against 27.7 at one
sequence, 66.4 against 52.3 at eight (default model, 2 cores; two OpenMP thread teams)."""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING

from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, StepStatus
from engine.executor.base import FinishedStep, StepHandle
from engine.worker_messages import WorkerConfig
from monitor.slo_preempt_signal import SLOPreemptSignal

if TYPE_CHECKING:
    from workers.launched_step import LaunchedStep
    from workers.model_runner import ModelRunner
    from workers.worker import Worker


class InProcessExecutor:
    def __init__(self, config: WorkerConfig, signal: SLOPreemptSignal | None = None) -> None:
        """``signal``: EngineCore's own preempt signal, which the worker's vote reads (and
        leaves to EngineCore to close)."""
        # Deferred, as every import of workers here: the model code loads only where it runs.
        from workers.worker import Worker

        self.worker: Worker | None = Worker(config, signal=signal)
        self.worker.start()
        self.num_kv_blocks = self.worker.num_kv_blocks

    @property
    def overlaps_host(self) -> bool:
        """Whether a submitted step runs while the host goes on (a GPU's stream)."""
        runner = self.runner
        return runner is not None and runner.device.type == "cuda"

    @property
    def runner(self) -> ModelRunner | None:
        """The model runner (benchmarks and tests read it); None once shut down."""
        return self.worker.runner if self.worker is not None else None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        try:
            assert self.worker is not None and self.worker.runner is not None, "shut down"
            return self.worker.runner.execute(scheduler_output)
        except Exception:  # reported as a structured status, as a remote worker would
            return _error_output(scheduler_output.step_id)

    def submit_model(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Launch the step and return at once; its handle's ``result()`` waits for it. Never
        raises: a step that fails to launch or to finish comes back with an ERROR status."""
        try:
            assert self.worker is not None and self.worker.runner is not None, "shut down"
            return _InProcessStep(scheduler_output.step_id,
                                  self.worker.runner.launch(scheduler_output))
        except Exception:  # reported as a structured status, as a remote worker would
            return FinishedStep(_error_output(scheduler_output.step_id))

    def shutdown(self) -> None:
        # The worker holds the last reference to the runner: nothing it reaches refers back to
        # it (workers.graphs.cuda_graphs), so its weights, KV pool and graphs are freed here, not at
        # the next garbage collection (tests/engine/test_engine_release.py).
        if self.worker is not None:
            self.worker.release()
        self.worker = None


class _InProcessStep:
    """A launched step's handle (``InProcessExecutor.submit_model``)."""

    def __init__(self, step_id: int, launched: LaunchedStep) -> None:
        self._step_id = step_id
        self._launched = launched

    def result(self) -> ModelRunnerOutput:
        try:
            return self._launched.result()
        except Exception:  # as execute_model reports it
            return _error_output(self._step_id)


def _error_output(step_id: int) -> ModelRunnerOutput:
    """The ERROR output of a step that raised (called in the ``except`` block: it carries the
    traceback being handled)."""
    return ModelRunnerOutput(step_id=step_id, status=StepStatus.ERROR,
                             error=traceback.format_exc())
