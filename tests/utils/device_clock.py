"""A clock for the simulated device (engine.executor.simulated.SimulatedExecutor's `clock` and
`sleep`): its sleeps advance it at once, so simulated steps take their profile's time on it and
no wall time."""

from __future__ import annotations


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)
