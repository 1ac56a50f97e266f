"""What `EngineCore.step` hands its step observers: one `StepTiming` per call, when it returns.

The hook exists so that benchmarks and diagnostics can time the engine's own steps without
wrapping its methods (a wrapper over bound methods ties the engine into a reference cycle and
breaks as soon as a method is renamed). An observer is any callable appended to
`EngineCore.step_observers`; with none there, a step reads no clock for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.core.scheduler_output import SchedulerOutput


@dataclass
class StepTiming:
    """One `EngineCore.step()` call, on `time.perf_counter()`'s clock.

    `started`/`ended` bound the whole call (scheduling, the forward pass, the output update), so
    that the gap from one step's start to the next one's counts the caller's output processing
    too. `scheduled` is what the forward pass ran, `None` where the call ran none (nothing to do,
    nothing admissible, or only frees to deliver)."""

    started: float
    ended: float = 0.0
    scheduled: SchedulerOutput | None = None
    # Wall seconds of `executor.execute_model` for `scheduled` (0.0 where none ran).
    execute_seconds: float = 0.0
    # TP: time rank 0 spent handing the step to the other ranks (ModelRunnerOutput's).
    transport_seconds: float = 0.0

    @property
    def requests(self) -> list[tuple[int, int]]:
        """Each scheduled request's (start position, tokens this step): 1 token is a decode."""
        if self.scheduled is None:
            return []
        return [(r.start_pos, len(r.token_ids)) for r in self.scheduled.requests]


# Called from the engine loop's thread as each step returns; it must not raise and must be quick.
StepObserver = Callable[[StepTiming], None]
