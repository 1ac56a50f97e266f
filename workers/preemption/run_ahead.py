"""Pace the host to the GPU during a preemptible step, so that a vote can still stop it.

CUDA launches are asynchronous: left alone, the host would queue every layer of a long prefill
within milliseconds and then wait for the result, so the votes before each attention op would all
be cast before the GPU had computed anything, and an urgent arrival during the step would find no
vote left to stop it. The limit keeps the host at most ``window`` layers ahead of the device: before
voting at layer L it waits for the GPU to reach the boundary of layer L - window (an event recorded
when the host passed it). The work a preempt leaves queued (about ``window`` layers) still runs
and is dropped, and the urgent step queues behind it: the device is free ``window`` + 1/2 layers
after a stop is decided on average, ``window`` + 1 at worst.

One layer is the default. When the host wakes at boundary L - 1, the device still has that
layer's attention and MLP and layer L's first ops queued, far more than the host needs to vote and
launch the next layer (well under a millisecond; a 512-token layer of an 8B model is 0.5 ms
on an H100). Two layers, the first default, left an urgent turn ~90 ms behind a 28k-token prefill on
the H100 (2026-11-27: 44 ms layers; urgent TTFT 123 ms against a 12 ms prefill of its own).

Only preemptible steps are paced; the others run fully asynchronously (and are where CUDA graphs
could go).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class _Event(Protocol):
    def record(self) -> None: ...
    def synchronize(self) -> None: ...


class RunAheadLimit:
    def __init__(self, window: int = 1,
                 make_event: Callable[[], _Event] | None = None) -> None:
        if window < 1:
            raise ValueError(f"run-ahead window must be >= 1 layer, got {window}")
        self.window = window
        # Blocking events put the waiting host thread to sleep instead of spinning a core that
        # the monitor and the HTTP front end need.
        self.make_event = make_event or (lambda: torch.cuda.Event(blocking=True))

    def pace(self, hook: Callable[[int], None]) -> Callable[[int], None]:
        """``hook`` (the vote), called once the device is within the window; one per step."""
        boundaries: dict[int, _Event] = {}

        def paced(layer: int) -> None:
            event = self.make_event()
            event.record()
            boundaries[layer] = event
            reached = boundaries.pop(layer - self.window, None)
            if reached is not None:
                reached.synchronize()  # releases the GIL: the monitor keeps running
            hook(layer)

        return paced
