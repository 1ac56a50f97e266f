"""The in-process executor: TP=1, one worker (rank 0, in no process group) in EngineCore's own
process, started by the same sequence as every other rank (workers.worker.Worker.start)."""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING

from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, StepStatus
from engine.worker_messages import WorkerConfig
from monitor.slo_preempt_signal import SLOPreemptSignal

if TYPE_CHECKING:
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
    def runner(self) -> ModelRunner | None:
        """The model runner (benchmarks and tests read it); None once shut down."""
        return self.worker.runner if self.worker is not None else None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        try:
            assert self.worker is not None and self.worker.runner is not None, "shut down"
            return self.worker.runner.execute(scheduler_output)
        except Exception:  # reported as a structured status, as a remote worker would
            return ModelRunnerOutput(step_id=scheduler_output.step_id, status=StepStatus.ERROR,
                                     error=traceback.format_exc())

    def shutdown(self) -> None:
        # The worker holds the last reference to the runner: nothing it reaches refers back to
        # it (workers.graphs.cuda_graphs), so its weights, KV pool and graphs are freed here, not at
        # the next garbage collection (tests/engine/test_engine_release.py).
        if self.worker is not None:
            self.worker.release()
        self.worker = None
