"""Requests that arrived but are not in the scheduler yet, as whoever watches the engine during
a step sees them (the monitor's gate, the fleet's load report)."""

from __future__ import annotations

from collections.abc import Iterator

from monitor.policy import RequestView


class PendingArrivals:
    """Arrivals by sequence number. The reader thread adds them (`note`); a reader drops those
    the scheduler has drained (every `seq <= drained`) as it reads the rest. Safe without a
    lock: a dict's single-key operations are atomic, and the keys are copied before iterating."""

    def __init__(self) -> None:
        self._views: dict[int, RequestView] = {}

    def note(self, seq: int, view: RequestView) -> None:
        self._views[seq] = view

    def pending(self, drained: int) -> list[RequestView]:
        """The arrivals after sequence number `drained`, oldest first."""
        views: list[RequestView] = []
        for seq in list(self._views):
            if seq <= drained:
                self._views.pop(seq, None)
            elif (view := self._views.get(seq)) is not None:
                views.append(view)
        return views

    def __iter__(self) -> Iterator[int]:
        """The sequence numbers held (not yet dropped), oldest first."""
        return iter(list(self._views))

    def any_with_deadline(self) -> bool:
        return any(v.deadline is not None for v in list(self._views.values()))
