"""The LAYER_DELAY_ENV test hook slows a step where a real CUDA graph replay would slow it too.

A replayed CUDA graph runs no Python: only what runs eagerly between the pieces of a piecewise
step (the attention op, the vote) can slow it on a GPU. The CPU stand-in for graphs
(EagerReplayBackend) calls the captured Python again on every replay, so a hook inside a piece
would still sleep on the CPU and a GPU test built on it would find its long step fast. Here
every captured piece and whole decode graph runs with a flag set, and the hook's sleeps are
recorded with that flag: none may come from inside a graph."""

from __future__ import annotations

import time

import pytest
import torch

from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.sampling_params import SamplingParams
from workers.graphs.cuda_graphs import EagerReplayBackend, capture_decode_graphs
from workers.preemption.layer_delay import LAYER_DELAY_ENV, install_layer_delay, layer_delay_of
from workers.model_runner import ModelRunner
from workers.graphs.piecewise_graphs import capture_piecewise_graphs
from workers.step_buffers import StepLimits
from tests.utils.runner_configs import runner_config

BLOCK = 16
MAX_MODEL_LEN = 128
MAX_TOKENS = 64
MAX_NUM_SEQS = 4
NUM_LAYERS = 3
DELAY_US_PER_TOKEN = 100
_greedy = SamplingParams(temperature=0)


class GraphFlaggingBackend(EagerReplayBackend):
    """The CPU stand-in, with ``inside_graph`` set while a captured function runs (at capture
    and at every replay): what runs then is what a real replay would not run in Python."""

    def __init__(self) -> None:
        self.inside_graph = False

    def capture(self, fn):
        return super().capture(self._flagged(fn))

    def _flagged(self, fn):
        def captured():
            self.inside_graph = True
            try:
                return fn()
            finally:
                self.inside_graph = False
        return captured


@pytest.fixture
def runner(tiny_model, monkeypatch) -> ModelRunner:
    monkeypatch.setenv(LAYER_DELAY_ENV, str(DELAY_US_PER_TOKEN))
    model = tiny_model("llama", num_hidden_layers=NUM_LAYERS)
    return ModelRunner(runner_config(model, num_blocks=64, block_size=BLOCK,
                                     limits=StepLimits(MAX_TOKENS, MAX_NUM_SEQS, MAX_MODEL_LEN)),
                       torch.device("cpu"))


def _record_sleeps(monkeypatch, backend: GraphFlaggingBackend) -> list[tuple[bool, float]]:
    """Every time.sleep as (called inside a graph, seconds); nothing really sleeps."""
    sleeps: list[tuple[bool, float]] = []
    monkeypatch.setattr(time, "sleep", lambda seconds: sleeps.append(
        (backend.inside_graph, seconds)))
    return sleeps


def _capture(runner: ModelRunner, backend: GraphFlaggingBackend) -> None:
    # As workers.worker.Worker.start does: the hook goes on after the startup passes.
    runner.graphs = capture_decode_graphs(runner, MAX_NUM_SEQS, MAX_MODEL_LEN, backend=backend)
    runner.piecewise = capture_piecewise_graphs(runner, MAX_TOKENS, backend)
    assert install_layer_delay(runner) is layer_delay_of(runner) is not None


def _prefill(req_id: str, tokens: int, first_block: int) -> ScheduledRequest:
    prompt = list(range(3, 3 + tokens))
    return ScheduledRequest(req_id=req_id, token_ids=prompt, start_pos=0,
                            block_ids=list(range(first_block, first_block + -(-tokens // BLOCK))),
                            sample=True, sampling_params=_greedy)


def test_a_piecewise_step_sleeps_between_the_pieces(runner, monkeypatch) -> None:
    backend = GraphFlaggingBackend()
    sleeps = _record_sleeps(monkeypatch, backend)
    _capture(runner, backend)
    assert sleeps == []  # installed after the capture
    out = runner.execute(SchedulerOutput(step_id=1, requests=[_prefill("p", 20, 0)]))
    assert not out.failed
    assert runner.piecewise.replays == 1  # probe: the step ran as pieces
    # Once per layer, for the step's real tokens (not its padded size), outside every piece.
    assert sleeps == [(False, pytest.approx(20 * DELAY_US_PER_TOKEN * 1e-6))] * NUM_LAYERS


def test_an_eager_step_sleeps_once_per_layer(runner, monkeypatch) -> None:
    backend = GraphFlaggingBackend()
    sleeps = _record_sleeps(monkeypatch, backend)
    assert install_layer_delay(runner) is not None  # as the worker does, with no graphs
    out = runner.execute(SchedulerOutput(step_id=1, requests=[_prefill("p", 20, 0)]))
    assert not out.failed and runner.piecewise is None
    assert sleeps == [(False, pytest.approx(20 * DELAY_US_PER_TOKEN * 1e-6))] * NUM_LAYERS


def test_a_whole_decode_graph_is_not_slowed(runner, monkeypatch) -> None:
    """A decode step replayed as one graph runs no Python between its layers on a GPU, so the
    stand-in does not sleep in it either: the CPU times what a GPU would."""
    backend = GraphFlaggingBackend()
    sleeps = _record_sleeps(monkeypatch, backend)
    _capture(runner, backend)
    first = runner.execute(SchedulerOutput(step_id=1, requests=[_prefill("p", 20, 0)]))
    sleeps.clear()
    decode = ScheduledRequest(req_id="p", token_ids=[first.sampled_token_ids["p"]], start_pos=20,
                              block_ids=[0, 1], sample=True, sampling_params=_greedy)
    out = runner.execute(SchedulerOutput(step_id=2, requests=[decode]))
    assert not out.failed and runner.graphs.replays == 1  # probe: a whole-graph replay
    assert sleeps == []
    # The hook is live again after it: the next piecewise step sleeps.
    runner.execute(SchedulerOutput(step_id=3, requests=[_prefill("q", 5, 8)]))
    assert len(sleeps) == NUM_LAYERS and not any(inside for inside, _ in sleeps)
