"""The executor protocol: how EngineCore runs a step, whatever runs it."""

from __future__ import annotations

from typing import Protocol

from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    # The KV blocks each rank holds (measured on the GPU when the configuration left it open).
    num_kv_blocks: int

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Never raises for a failed step: it comes back with an ERROR status."""
        ...

    def shutdown(self) -> None: ...
