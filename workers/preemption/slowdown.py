"""The test hook that makes a machine `k` times slower: every step of the model runner takes `k`
times as long, outputs unchanged, and the time added lies between the layers as the compute
does, so a slowed prefill can still be stopped at its attention ops.

With SLOWDOWN_ENV set (in the environment, so that spawned TP workers inherit it) to a factor
(`2`, `3`), or to a file holding one, every runner sleeps `k - 1` times the time each stretch of
its step took: at every attention op (the stretch since the previous one) and at the step's end
(the rest, its execute_seconds made to include it). A file is read again at every step, so that
a test can change the machine's speed while the engine serves (a neighbour starting, a clock
throttling). Installed after the startup passes, like the slow-layer hook beside it. It wraps
`ModelRunner.execute`, the serial loop's path: a CPU engine never queues steps (async scheduling
keeps the serial loop there)."""

from __future__ import annotations

import os
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from workers.layers.linear import weakly_bound
from workers.preemption.layer_delay import observe_attention_ops

if TYPE_CHECKING:
    from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from workers.model_runner import ModelRunner

SLOWDOWN_ENV = "SLOSERVE_TEST_SLOWDOWN"


def read_factor(setting: str) -> float:
    """A factor, or the factor in the file `setting` names; 1.0 while the file is missing."""
    try:
        return float(setting)
    except ValueError:
        pass
    try:
        text = Path(setting).read_text().strip()
    except FileNotFoundError:
        return 1.0
    factor = float(text)
    if not factor >= 1.0:
        raise ValueError(f"{SLOWDOWN_ENV}: a factor >= 1, got {text!r} in {setting}")
    return factor


class Slowdown:
    """Sleeps `factor - 1` times each stretch of a step (see the module's text)."""

    def __init__(self, setting: str) -> None:
        self.setting = setting
        self.factor = read_factor(setting)
        self._stamp: float | None = None
        # Seconds slept in total: the probe that the machine really was slowed.
        self.slept_s = 0.0

    def step_started(self) -> None:
        self.factor = read_factor(self.setting)
        self._stamp = time.perf_counter()

    def stretch_ended(self) -> float:
        """Sleeps for the stretch since the last stamp; the seconds slept."""
        if self._stamp is None or self.factor <= 1.0:
            return 0.0
        extra = (self.factor - 1.0) * (time.perf_counter() - self._stamp)
        time.sleep(extra)
        self.slept_s += extra
        self._stamp = time.perf_counter()
        return extra

    def step_ended(self) -> float:
        extra = self.stretch_ended()
        self._stamp = None
        return extra


_installed: weakref.WeakKeyDictionary[ModelRunner, Slowdown] = weakref.WeakKeyDictionary()


def install_slowdown(runner: ModelRunner) -> Slowdown | None:
    """With SLOWDOWN_ENV set, make every step of ``runner`` its factor times as long."""
    setting = os.environ.get(SLOWDOWN_ENV)
    if not setting:
        return None
    slowdown = Slowdown(setting)
    observe_attention_ops(runner.model, lambda _layer, _tokens: slowdown.stretch_ended())
    execute = weakly_bound(runner.execute)

    def execute_slowed(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        slowdown.step_started()
        output = execute(scheduler_output)
        output.execute_seconds += slowdown.step_ended()
        return output

    runner.execute = execute_slowed  # type: ignore[method-assign]
    _installed[runner] = slowdown
    return slowdown


def slowdown_of(runner: ModelRunner) -> Slowdown | None:
    """The hook ``install_slowdown`` put on ``runner``, if any."""
    return _installed.get(runner)
