"""Whether a model runner's memory is freed the moment its owner drops it.

On a GPU, an engine's weights, KV pool and CUDA graphs must be gone when the engine is shut down
and dropped: the next engine in the process sizes its KV pool from the device memory left free.
Nothing the runner reaches may form a reference cycle with it (workers.graphs.cuda_graphs), so reference
counting alone frees it; these probes check that, with the garbage collector off.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator
from typing import Any


def runner_probes(runner: Any) -> dict[str, weakref.ref]:
    """Weak references to what a runner holds on the device: itself, its model, a layer and
    that layer's weight, the embedding's weight (shared with a tied LM head) and a KV cache
    tensor."""
    model = runner.model
    layer = model.model.layers[0].mlp.down_proj
    probes = {"runner": weakref.ref(runner), "model": weakref.ref(model),
              "layer": weakref.ref(layer), "layer weight": weakref.ref(layer.weight),
              "embedding weight": weakref.ref(model.model.embed_tokens.weight)}
    if runner.kv_caches:
        probes["kv cache"] = weakref.ref(runner.kv_caches[0][0])
    return probes


def outlived(probes: dict[str, weakref.ref]) -> list[str]:
    """The names of the probed objects still alive."""
    return [name for name, ref in probes.items() if ref() is not None]


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """No automatic garbage collection inside: an object freed there was freed by reference
    counting, not by a collection that happened to run."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
