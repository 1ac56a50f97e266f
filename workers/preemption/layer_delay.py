"""Watching a model's attention ops, and the test hook built on it that slows every layer.

A tiny test model's layers are too quick to stop a pass between them: with LAYER_DELAY_ENV set
(in the environment, so that spawned TP workers inherit it), every model runner sleeps per token
at each layer's attention op. Kept out of the model runner's code: the worker installs it once
the runner is ready to serve (workers.worker.Worker.start), and only when the variable is set."""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from workers.layers.linear import weakly_bound

if TYPE_CHECKING:
    from workers.model_runner import ModelRunner

# Test hook: sleep this many microseconds per token in every decoder layer, so that a tiny model's
# layers last long enough to observe a preemption between them (set in the environment, so that
# spawned TP workers inherit it).
LAYER_DELAY_ENV = "SLOSERVE_TEST_LAYER_DELAY_US_PER_TOKEN"

def observe_attention_ops(model: torch.nn.Module,
                          observer: Callable[[int, int], None]) -> Callable[[], None]:
    """Call ``observer(layer_idx, num_tokens)`` before every attention op of ``model`` (before
    the vote), for the tokens active at that layer (padding excluded); returns a function that
    stops it. For tests and benchmarks that slow a layer or act when a step reaches it.

    It watches the attention boundary (``model.attention_boundary``), where Python runs both in
    an eager pass and between the replayed pieces of a piecewise-graph step
    (workers.graphs.piecewise_graphs), whether the pieces hold the attention or not. A hook
    inside a piece (a module forward hook on a layer or its norm) runs on the CPU stand-in for
    graphs, whose "replay" calls the captured Python again, but never in a real CUDA graph
    replay. A step replayed as one whole graph (a decode step; a mixed step that cannot be
    stopped, where the pieces hold the attention) runs no boundary in Python on a GPU."""
    # Weakly bound: the model keeps the wrapper, which must not keep the model (a cycle would
    # hold its weights until the next garbage collection).
    inner = weakly_bound(model.attention_boundary)
    observing = [True]

    # Wraps the instance's boundary: the eager forward pass and the piecewise runner both call
    # it through the instance, never the class.
    def observed_boundary(layer_idx: int, num_tokens: int) -> None:
        if observing[0]:
            observer(layer_idx, num_tokens)
        inner(layer_idx, num_tokens)

    model.attention_boundary = observed_boundary

    def stop() -> None:
        observing[0] = False

    return stop


class LayerDelay:
    """The LAYER_DELAY_ENV test hook: sleeps per token at every layer's attention op, before
    the vote: where an eager pass and a piecewise-graph step both run Python, so a GPU test's
    long step is slow with graphs on too (observe_attention_ops). A decode step replayed as one
    whole graph is not slowed, on a GPU nor on the CPU stand-in. Paused during the startup
    passes (kernel warm-up, graph capture): installed after them."""

    def __init__(self, model: torch.nn.Module, seconds_per_token: float) -> None:
        self.seconds_per_token = seconds_per_token
        self.paused = False
        observe_attention_ops(model, lambda _layer_idx, num_tokens: self._delay(num_tokens))

    def _delay(self, num_tokens: int) -> None:
        if not self.paused:
            time.sleep(self.seconds_per_token * num_tokens)

    @contextlib.contextmanager
    def paused_for_a_whole_graph(self) -> Iterator[None]:
        """Around a whole-graph replay (on the CPU stand-in, which calls the captured pass
        again): a GPU replay runs none of it in Python, so nothing is slowed."""
        was_paused, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = was_paused


# The hook installed on each runner (tests read it through layer_delay_of); weak, so that the
# hook never keeps a runner alive.
_installed: weakref.WeakKeyDictionary[ModelRunner, LayerDelay] = weakref.WeakKeyDictionary()


def install_layer_delay(runner: ModelRunner) -> LayerDelay | None:
    """With LAYER_DELAY_ENV set, slow every layer of ``runner``'s model from now on: after the
    startup passes, which no test times. A whole-graph replay is left unslowed, as a GPU runs
    none of its attention ops in Python (the CPU stand-in for graphs calls them again)."""
    delay_us = os.environ.get(LAYER_DELAY_ENV)
    if not delay_us:
        return None
    delay = LayerDelay(runner.model, float(delay_us) * 1e-6)
    if runner.graphs is not None:
        replay = weakly_bound(runner.graphs.replay)

        def replay_unslowed(*args: Any, **kwargs: Any) -> Any:
            with delay.paused_for_a_whole_graph():
                return replay(*args, **kwargs)

        runner.graphs.replay = replay_unslowed  # type: ignore[method-assign]
    _installed[runner] = delay
    return delay


def layer_delay_of(runner: ModelRunner) -> LayerDelay | None:
    """The hook ``install_layer_delay`` put on ``runner``, if any."""
    return _installed.get(runner)
