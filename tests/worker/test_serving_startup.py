"""The startup before serving (workers.startup.serving_startup): the graph capture runs with the garbage
collector off and every object alive before it frozen (a collection mid-capture could free what
a capture in progress refers to), restored afterwards, a failed capture included; and the runner
reports what the startup cost (``runner.startup_report``), here with the CPU stand-in for graphs
(workers.graphs.cuda_graphs.EagerReplayBackend)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine import LLM
from workers.graphs.cuda_graphs import FAKE_GRAPHS_ENV, EagerReplayBackend, capture_decode_graphs
from workers.model_runner import ModelRunner
from workers.graphs.piecewise_graphs import capture_piecewise_graphs
from workers.startup.startup_report import ServingStartup
from workers.step_buffers import StepLimits
from tests.utils.runner_configs import runner_config

MAX_MODEL_LEN = 128
MAX_NUM_SEQS = 4
MAX_TOKENS = 64


class CollectorProbe(EagerReplayBackend):
    """Notes, inside each captured function, whether the collector could run there (and how
    many objects were frozen); ``fail_at``: the capture that raises (1-based)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.seen: list[tuple[bool, int]] = []
        self.fail_at = fail_at

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        def probed() -> torch.Tensor:
            self.seen.append((gc.isenabled(), gc.get_freeze_count()))
            if len(self.seen) == self.fail_at:
                raise RuntimeError("capture failed")
            return fn()

        return super().capture(probed)


@pytest.fixture
def runner(tiny_model) -> ModelRunner:
    model = tiny_model("llama", num_hidden_layers=2)
    return ModelRunner(runner_config(model, num_blocks=32, block_size=16,
                                     limits=StepLimits(MAX_TOKENS, MAX_NUM_SEQS, MAX_MODEL_LEN)),
                       torch.device("cpu"))


def _capture_both(runner: ModelRunner, backend: EagerReplayBackend) -> None:
    capture_decode_graphs(runner, MAX_NUM_SEQS, MAX_MODEL_LEN, backend=backend)
    capture_piecewise_graphs(runner, MAX_TOKENS, backend)


def test_capture_runs_with_the_collector_off_and_frozen(runner) -> None:
    assert gc.isenabled() and gc.get_freeze_count() == 0
    backend = CollectorProbe()

    _capture_both(runner, backend)

    # Probe: both kinds were captured (decode sizes 1, 2, 4; pieces of 3 layers' worth).
    assert len(backend.seen) > 3 + 3
    assert all(not enabled and frozen > 0 for enabled, frozen in backend.seen), backend.seen
    assert gc.isenabled() and gc.get_freeze_count() == 0


@pytest.mark.parametrize("fail_at", [1, 5])
def test_collector_is_restored_when_a_capture_fails(runner, fail_at: int) -> None:
    backend = CollectorProbe(fail_at=fail_at)

    with pytest.raises(RuntimeError, match="CUDA graph capture failed"):
        _capture_both(runner, backend)

    assert len(backend.seen) == fail_at
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_collector_left_off_stays_off(runner) -> None:
    """A process that runs with the collector off (the release tests, a server tuned so)
    finds it off after the capture, not turned on."""
    gc.disable()
    try:
        _capture_both(runner, CollectorProbe())
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_an_earlier_freeze_is_left_in_place(runner) -> None:
    """Objects something else froze before stay frozen (an unfreeze here would undo that);
    the collector is still off during the capture."""
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        backend = CollectorProbe()
        _capture_both(runner, backend)
        assert all(not enabled for enabled, _ in backend.seen)
        # Frozen objects may still be freed by reference counting meanwhile, so the count can
        # drop a little; an unfreeze here would have emptied it.
        assert gc.isenabled() and gc.get_freeze_count() > frozen // 2
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_runner_reports_what_the_startup_cost(tiny_model, monkeypatch,
                                              enforce_eager: bool) -> None:
    monkeypatch.setenv(FAKE_GRAPHS_ENV, "1")
    llm = LLM(model=tiny_model("llama", num_hidden_layers=2), dtype="float32", device="cpu",
              max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_TOKENS,
              max_num_seqs=MAX_NUM_SEQS, enforce_eager=enforce_eager,
              startup_calibration=False)
    try:
        runner = llm.engine.executor.runner
        report = runner.startup_report
    finally:
        llm.shutdown()
    assert isinstance(report, ServingStartup)
    assert report.warmup_s >= 0.0
    assert report.graph_memory_bytes is None  # not on CUDA
    if enforce_eager:
        assert (report.capture_s, report.decode_sizes, report.pieces, report.graphs) == (0.0, 0,
                                                                                         0, 0)
        return
    assert report.capture_s > 0.0
    assert report.decode_sizes == len(runner.graphs.graphs) > 0
    assert report.piece_sizes == len(runner.piecewise.graphs) > 0
    assert report.pieces == report.piece_sizes * (2 + 1)
    assert report.graphs == report.decode_sizes + report.pieces
