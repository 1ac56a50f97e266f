"""Catch host syncs inside the decoder layers of a forward pass (test helper).

A read of a tensor's value on the host (``.item()``, ``.tolist()``, ``int(t)``, ``if t:``, ...)
waits for the device to finish everything queued before it, and cannot be captured in a CUDA
graph. Between entering the first decoder layer and leaving the last, the only host interaction
allowed is the preemption vote and the run-ahead pacing at the attention boundary
(``workers.preemption.slo_preempt_vote`` / ``workers.preemption.run_ahead``, the functions named in
``EXEMPT``); every
other value the step needs is computed before the forward pass (``ModelRunner.prepare_inputs``).

``HostSyncDetector`` patches those ``torch.Tensor`` methods for the duration of a ``with`` block
and records the call stack of each one made while armed. ``watch(model)`` arms it on entering
any decoder layer and disarms it on leaving the last one (a step unwound by a vote never gets
there: ``disarm()`` after every step).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Each of these reads a tensor's value into Python: on a GPU the host waits for the device.
SYNCING_METHODS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__",
                   "__index__", "__array__")

# (module file, function) pairs allowed to read values back: the vote and the pacing. A call
# made anywhere below one of these frames is exempt.
EXEMPT = (
    (os.path.join("workers", "preemption", "slo_preempt_vote.py"), "__call__"),
    (os.path.join("workers", "preemption", "run_ahead.py"), "paced"),
)


@dataclass
class HostSync:
    method: str
    stack: list[traceback.FrameSummary]

    def __str__(self) -> str:
        frames = "".join(traceback.format_list(self.stack[-6:]))
        return f"Tensor.{self.method} inside the decoder layers:\n{frames}"


def _exempt(stack: list[traceback.FrameSummary]) -> bool:
    return any(frame.filename.endswith(path) and frame.name == name
               for frame in stack for path, name in EXEMPT)


class HostSyncDetector:
    def __init__(self) -> None:
        self.armed = False
        self.found: list[HostSync] = []
        self.exempted: list[HostSync] = []
        # Layers entered while watching: the probe that the forward passes really ran.
        self.layers_entered = 0
        self._originals: dict[str, Callable[..., Any]] = {}
        self._inside = False  # a patched method calling another is one sync, not two

    def __enter__(self) -> HostSyncDetector:
        for name in SYNCING_METHODS:
            original = getattr(torch.Tensor, name, None)
            if original is None:
                continue
            self._originals[name] = original
            setattr(torch.Tensor, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        self._originals.clear()
        self.armed = False

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.armed and not self._inside:
                stack = traceback.extract_stack()[:-1]
                sync = HostSync(name, stack)
                (self.exempted if _exempt(stack) else self.found).append(sync)
            outer, self._inside = self._inside, True
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._inside = outer

        patched.__name__ = name
        return patched

    def watch(self, model: torch.nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        """Arm on entering any decoder layer of ``model`` (a resumed pass may start above
        layer 0), disarm on leaving the last. Returns the hook handles."""
        layers = model.model.layers

        def arm(_module: torch.nn.Module, _args: tuple) -> None:
            self.armed = True
            self.layers_entered += 1

        def disarm(_module: torch.nn.Module, _args: tuple, _out: Any) -> None:
            self.armed = False

        handles = [layer.register_forward_pre_hook(arm) for layer in layers]
        handles.append(layers[-1].register_forward_hook(disarm))
        return handles

    def disarm(self) -> None:
        self.armed = False

    def report(self) -> str:
        return "\n".join(str(sync) for sync in self.found)
