"""The GPU run-ahead limit, with recording stand-ins for CUDA events: before the vote at layer L
the host has waited for the device to reach layer L - window, and never for a later one."""

from __future__ import annotations

import pytest

from workers.preemption.run_ahead import RunAheadLimit


class _Log:
    def __init__(self) -> None:
        self.entries: list[tuple[str, int]] = []
        self.recording_layer = -1

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
