"""How EngineCore runs a step on the workers. EngineCore's code does not depend on the choice."""

from __future__ import annotations

import traceback
from typing import Protocol

from engine.scheduler_output import ModelRunnerOutput, SchedulerOutput, StepStatus


class Executor(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    """TP=1: the model runner lives in the EngineCore process; no extra process, no IPC."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        try:
            return self.runner.execute(scheduler_output)
        except Exception:  # reported as a structured status, as a remote worker would
            return ModelRunnerOutput(step_id=scheduler_output.step_id, status=StepStatus.ERROR,
                                     error=traceback.format_exc())

    def shutdown(self) -> None:
        self.runner = None
