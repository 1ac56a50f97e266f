"""Counting an engine's kernel ops by what ran, CUDA graphs included.

Counting Python calls of the ops (a wrapped backend handed to ``model.use_kernels`` after the
engine started) misses every step a CUDA graph replays: a real replay relaunches the kernels
its capture recorded and calls no Python, so such a count reads 0 for a fused op that ran
thousands of times. Here an op call made eagerly counts once; one made while a graph was being
captured counts once per replay of that graph. On the CPU stand-in for graphs (whose replay
does call the Python again) those calls are not counted a second time.

    ran = KernelsRan.install(monkeypatch)   # before the engine is built
    llm = LLM(...)
    before = ran.snapshot()
    llm.generate(...)
    counts = ran.since(before)
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from workers.graphs.cuda_graphs import CudaGraphBackend, EagerReplayBackend

OPS = ("write_kv_cache", "paged_attention", "rms_norm", "apply_rotary", "silu_and_mul",
       "fused_moe", "gelu_tanh_and_mul", "rms_norm_float32_scale")


class KernelsRan:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        # While a graph is captured: the calls of one run of its function (the CUDA backend
        # runs it for warm-up before the capture; each run makes the same calls).
        self._capturing: Counter[str] | None = None
        # While a graph is replayed: the stand-in calls the Python again; not counted twice.
        self._replaying = False
        # id(graph handle) -> (the handle, kept alive so the id stays unique; its calls).
        self._per_graph: dict[int, tuple[Any, Counter[str]]] = {}

    @classmethod
    def install(cls, monkeypatch: pytest.MonkeyPatch) -> KernelsRan:
        """Count the ops of every engine built in this test from now on (in this process)."""
        ran = cls()
        import workers.model_runner as model_runner

        select_backend = model_runner.select_backend
        monkeypatch.setattr(model_runner, "select_backend",
                            lambda *args, **kwargs: ran.counting(select_backend(*args, **kwargs)))
        for backend_class in (CudaGraphBackend, EagerReplayBackend):
            monkeypatch.setattr(backend_class, "capture", ran._capturing_with(
                backend_class.capture))
            monkeypatch.setattr(backend_class, "replay", ran._replaying_with(
                backend_class.replay))
        return ran

    def counting(self, kernels: Any) -> Any:
        """``kernels`` (a kernels.KernelBackend) with each op counted where it runs."""
        def wrap(name: str) -> Callable[..., Any] | None:
            inner = getattr(kernels, name)
            if inner is None:
                return None

            def counted(*args: Any, **kwargs: Any) -> Any:
                if self._replaying:
                    pass  # counted from the capture's record, in _replaying_with
                elif self._capturing is not None:
                    self._capturing[name] += 1
                else:
                    self.counts[name] += 1
                return inner(*args, **kwargs)
            return counted

        return dataclasses.replace(kernels, **{name: wrap(name) for name in OPS})

    def _capturing_with(self, capture: Callable[..., Any]) -> Callable[..., Any]:
        def counted_capture(backend: Any, fn: Callable[[], Any]) -> tuple[Any, Any]:
            calls: Counter[str] = Counter()

            def recorded() -> Any:
                calls.clear()
                outer, self._capturing = self._capturing, calls
                try:
                    return fn()
                finally:
                    self._capturing = outer

            handle, out = capture(backend, recorded)
            self._per_graph[id(handle)] = (handle, Counter(calls))
            return handle, out
        return counted_capture

    def _replaying_with(self, replay: Callable[..., Any]) -> Callable[..., Any]:
        def counted_replay(backend: Any, graph: Any) -> None:
            outer, self._replaying = self._replaying, True
            try:
                replay(backend, graph)
            finally:
                self._replaying = outer
            self.counts.update(self._per_graph[id(graph)][1])
        return counted_replay

    def snapshot(self) -> Counter[str]:
        return Counter(self.counts)

    def since(self, snapshot: Counter[str]) -> dict[str, int]:
        """Each op's runs since ``snapshot`` (0 for an op that did not run)."""
        return {name: self.counts[name] - snapshot[name] for name in OPS}
