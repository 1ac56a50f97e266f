"""The GPU run-ahead limit, with recording stand-ins for CUDA events: before the vote at layer L
the host has waited for the device to reach layer L - window, and never for a later one; once
the device is timed at a long layer, for layer L itself."""

from __future__ import annotations

import pytest

from workers.preemption.run_ahead import RunAheadLimit


class _Log:
    def __init__(self, layer_ms: float = 1.0) -> None:
        self.entries: list[tuple[str, int]] = []
        self.recording_layer = -1
        self.layer_ms = layer_ms  # what the device takes per layer, as the events time it

    def event(self) -> "_FakeEvent":
        return _FakeEvent(self)


class _FakeEvent:
    def __init__(self, log: _Log) -> None:
        self.log, self.layer = log, -1

    def record(self) -> None:
        self.layer = self.log.recording_layer
        self.log.entries.append(("record", self.layer))

    def synchronize(self) -> None:
        self.log.entries.append(("wait", self.layer))

    def elapsed_time(self, end: "_FakeEvent") -> float:
        return (end.layer - self.layer) * self.log.layer_ms


@pytest.mark.parametrize("window", [1, 2, 3])
def test_each_vote_waits_for_the_layer_a_window_back(window):
    log = _Log()
    limit = RunAheadLimit(window, make_event=log.event)
    paced = limit.pace(lambda layer: log.entries.append(("vote", layer)))
    for layer in range(6):
        log.recording_layer = layer
        paced(layer)
    waits = [layer for kind, layer in log.entries if kind == "wait"]
    assert waits == list(range(6 - window))
    for layer in range(window, 6):
        vote = log.entries.index(("vote", layer))
        # The wait for layer - window came before this vote, and after the previous one.
        assert log.entries.index(("wait", layer - window)) < vote
        if layer > window:
            assert log.entries.index(("vote", layer - 1)) < log.entries.index(
                ("wait", layer - window))


def test_each_step_starts_with_no_pending_boundaries():
    log = _Log()
    limit = RunAheadLimit(2, make_event=log.event)
    first = limit.pace(lambda layer: None)
    for layer in range(4):
        first(layer)
    log.entries.clear()
    second = limit.pace(lambda layer: None)
    second(0)
    second(1)
    # A new step never waits on the previous step's boundaries.
    assert [kind for kind, _ in log.entries] == ["record", "record"]


def test_a_window_below_one_layer_is_refused():
    with pytest.raises(ValueError, match="window must be >= 1"):
        RunAheadLimit(0)


def _run(limit: RunAheadLimit, log: _Log, layers: int) -> list[int]:
    windows: list[int] = []
    paced = limit.pace(lambda layer: log.entries.append(("vote", layer)),
                       on_window=windows.append)
    for layer in range(layers):
        log.recording_layer = layer
        paced(layer)
    return windows


def test_long_layers_leave_no_layer_queued_ahead_of_the_vote():
    """A 28k-token layer of an 8B model takes 41 ms on the H100: one queued layer kept an urgent
    turn 60 ms behind a stop on average (2026-11-28)."""
    log = _Log(layer_ms=41.0)
    windows = _run(RunAheadLimit(1, make_event=log.event), log, 6)
    assert windows == [1, 0]  # the step starts one layer ahead; the first timed layer is long
    waits = [layer for kind, layer in log.entries if kind == "wait"]
    assert waits == [0, 1, 2, 3, 4, 5]
    # From layer 2 on (layers 0 and 1 timed the device), each vote comes after the wait for
    # its own boundary: nothing of the step is queued on the device when it is cast.
    for layer in range(2, 6):
        assert log.entries.index(("wait", layer)) < log.entries.index(("vote", layer))
    # Probe: layer 1's vote still had layer 0 alone done (one layer queued).
    assert log.entries.index(("vote", 1)) < log.entries.index(("wait", 1))


@pytest.mark.parametrize("layer_ms, long_layer_s", [(9.9, 0.010), (41.0, None)])
def test_short_layers_or_no_threshold_keep_the_window(layer_ms, long_layer_s):
    log = _Log(layer_ms=layer_ms)
    windows = _run(RunAheadLimit(1, long_layer_s=long_layer_s, make_event=log.event), log, 6)
    assert windows == [1]
    assert [layer for kind, layer in log.entries if kind == "wait"] == [0, 1, 2, 3, 4]
