"""The executor protocol: how EngineCore runs a step, whatever runs it.

Every executor runs a step with `execute_model`, which returns once the step is done. One that
can overlap the host with the device also has `submit_model` (`Overlapping`): it queues the step
on the device and returns at once with a `StepHandle`, whose `result()` waits for that step
alone. Steps run in the order they were submitted, and a decode scheduled ahead
(`ScheduledRequest.last_token_pending`) takes its input token from the step before it on the
device, so the host may schedule and submit step N+1 before it reads step N's tokens
(EngineCore's async scheduling).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    # The KV blocks each rank holds (measured on the GPU when the configuration left it open).
    num_kv_blocks: int

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Never raises for a failed step: it comes back with an ERROR status."""
        ...

    def shutdown(self) -> None: ...


class StepHandle(Protocol):
    def result(self) -> ModelRunnerOutput:
        """Wait for the step and return its output (an ERROR status, never an exception, for a
        step that failed). Called once."""
        ...


@runtime_checkable
class Overlapping(Protocol):
    """An executor that can queue a step while the host goes on (see the module docstring)."""

    @property
    def overlaps_host(self) -> bool:
        """Whether a queued step runs while the host works: False where launching a step
        computes it (a CPU), where queueing would only hold each output back a step."""
        ...

    def submit_model(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Queue the step behind those submitted before; never raises for a failed step."""
        ...


class FinishedStep:
    """The handle of a step that already ran (an executor that had nothing to queue)."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def result(self) -> ModelRunnerOutput:
        return self._output
