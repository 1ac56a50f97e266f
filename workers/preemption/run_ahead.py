"""Pace the host to the GPU during a preemptible step, so that a vote can still stop it.

CUDA launches are asynchronous: left alone, the host would queue every layer of a long prefill
within milliseconds and then wait for the result, so the votes before each attention op would all
be cast before the GPU had computed anything, and an urgent arrival during the step would find no
vote left to stop it. The limit keeps the host at most ``window`` layers ahead of the device: before
voting at layer L it waits for the GPU to reach the boundary of layer L - window (an event recorded
when the host passed it). The work a preempt leaves queued (about ``window`` layers) still runs
and is dropped, and the urgent step queues behind it: the device is free ``window`` + 1/2 layers
after a stop is decided on average, ``window`` + 1 at worst.

One layer is where a step starts. When the host wakes at boundary L - 1, the device still has that
layer's attention and MLP and layer L's first ops queued, far more than the host needs to vote and
launch the next layer (well under a millisecond; a 512-token layer of an 8B model is 0.5 ms
on an H100). Two layers, the first default, left an urgent turn ~90 ms behind a 28k-token prefill on
the H100 (2026-11-27: 44 ms layers; urgent TTFT 123 ms against a 12 ms prefill of its own).

Zero layers once a step's layers are long. One layer still left the urgent turns behind a
28k-token prefill at 77-81 ms against a 55 ms objective (the H100, 2026-11-28: 41 ms layers, so
a stop freed the device 60 ms after it was decided, on average). From the first layer the device
is measured to take ``long_layer_s`` or more (the events time it), the host waits at each boundary
for the device to finish everything queued, then votes and launches the next layer: the device
idles for the host's wake-up and first launch (tens of microseconds, under 1% of such a layer),
and a stop frees it half a layer after it is decided on average.

Only preemptible steps are paced; the others run fully asynchronously (and are where CUDA graphs
could go).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

# A layer at least this long on the device is paced with no layer queued ahead: the host's
# wake-up and first launch between two layers (tens of microseconds) are under 1% of it.
LONG_LAYER_S = 0.010


class _Event(Protocol):
    def record(self) -> None: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end: _Event) -> float: ...  # milliseconds, as torch.cuda.Event's


class RunAheadLimit:
    def __init__(self, window: int = 1, long_layer_s: float | None = LONG_LAYER_S,
                 make_event: Callable[[], _Event] | None = None) -> None:
        """``long_layer_s``: from a layer this long on, no layer is queued ahead (None:
        ``window`` layers throughout)."""
        if window < 1:
            raise ValueError(f"run-ahead window must be >= 1 layer, got {window}")
        self.window = window
        self.long_layer_s = long_layer_s
        # Blocking events put the waiting host thread to sleep instead of spinning a core that
        # the monitor and the HTTP front end need; timed, to tell a long layer.
        self.make_event = make_event or (
            lambda: torch.cuda.Event(enable_timing=True, blocking=True))

    def pace(self, hook: Callable[[int], None],
             on_window: Callable[[int], None] | None = None) -> Callable[[int], None]:
        """``hook`` (the vote), called once the device is within the window; one per step.
        ``on_window(window)``: told the window the step starts with and each change (how far
        behind the host the device may be when the hook runs)."""
        boundaries: dict[int, _Event] = {}
        window = self.window
        reached_before: tuple[int, _Event] | None = None  # the last boundary waited for
        if on_window is not None:
            on_window(window)

        def paced(layer: int) -> None:
            nonlocal window, reached_before
            event = self.make_event()
            event.record()
            boundaries[layer] = event
            reached = boundaries.pop(layer - window, None)
            if reached is None:
                hook(layer)
                return
            reached.synchronize()  # releases the GIL: the monitor keeps running
            if window > 0 and self.long_layer_s is not None and reached_before is not None:
                layers = layer - window - reached_before[0]
                layer_s = reached_before[1].elapsed_time(reached) / 1000 / max(layers, 1)
                if layer_s >= self.long_layer_s:
                    window = 0
                    if on_window is not None:
                        on_window(0)
                    # This boundary's own wait, at once: the device finishes the layer queued.
                    event.synchronize()
            reached_before = (layer - window, reached) if window > 0 else None
            hook(layer)

        return paced
