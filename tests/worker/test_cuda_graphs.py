"""Decode-only steps replayed from captured graphs (workers.graphs.cuda_graphs), checked on the CPU
through a fake graph: its "capture" keeps the forward pass closed over the runner's static
buffers, its "replay" runs that again with no arguments. Greedy tokens must equal an eager run's,
which they can only do if every input of the step went through the buffers (a probe plants an
input that bypasses them and sees the tokens change)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import tests.utils.triton_device  # noqa: F401  (Triton's interpreter, before any kernels.triton_*)
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.sampling_params import SamplingParams
from tests.utils.paged_helpers import bypass_the_position_buffer
from workers.graphs.cuda_graphs import DecodeGraphs, EagerReplayBackend, capture_decode_graphs
from workers.model_runner import ModelRunner
from workers.step_buffers import StepLimits
from tests.utils.runner_configs import runner_config

BLOCK = 16
MAX_MODEL_LEN = 128
MAX_NUM_SEQS = 8
DECODE_STEPS = 6


class FakeGraphs(EagerReplayBackend):
    """The CPU stand-in for torch.cuda.CUDAGraph (workers.graphs.cuda_graphs.EagerReplayBackend),
    noting the batch size of every capture."""

    def __init__(self) -> None:
        self.captured: list[int] = []

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        graph, out = super().capture(fn)
        self.captured.append(out.shape[0])
        return graph, out


@pytest.fixture
def runner(tiny_model) -> ModelRunner:
    model = tiny_model("llama", num_hidden_layers=2)
    return ModelRunner(runner_config(model, num_blocks=64, block_size=BLOCK,
                                     limits=StepLimits(256, MAX_NUM_SEQS, MAX_MODEL_LEN)),
                       torch.device("cpu"))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_prompt(20, 1), _prompt(35, 2), _prompt(9, 3)]
_greedy = SamplingParams(temperature=0)


def _request(index: int, tokens: list[int], start: int, first_block: int) -> ScheduledRequest:
    blocks = list(range(first_block, first_block + -(-(start + len(tokens)) // BLOCK)))
    return ScheduledRequest(req_id=f"r{index}", token_ids=tokens, start_pos=start,
                            block_ids=blocks, sample=True, sampling_params=_greedy)


def _generate(runner: ModelRunner, first_block: int) -> dict[str, list[int]]:
    """Greedy: one prefill step, then decode steps; the last request stops two steps early,
    so the decode batches are 3 (padded to 4) and then 2."""
    firsts = {i: first_block + 8 * i for i in range(len(PROMPTS))}
    out = runner.execute(SchedulerOutput(step_id=1, requests=[
        _request(i, p, 0, firsts[i]) for i, p in enumerate(PROMPTS)]))
    tokens = {f"r{i}": [out.sampled_token_ids[f"r{i}"]] for i in range(len(PROMPTS))}
    for step in range(DECODE_STEPS):
        live = range(len(PROMPTS) if step < DECODE_STEPS - 2 else len(PROMPTS) - 1)
        requests = [_request(i, [tokens[f"r{i}"][-1]], len(PROMPTS[i]) + step, firsts[i])
                    for i in live]
        out = runner.execute(SchedulerOutput(step_id=2 + step, requests=requests))
        assert not out.failed
        for req in requests:
            tokens[req.req_id].append(out.sampled_token_ids[req.req_id])
    return tokens


def _capture(runner: ModelRunner) -> DecodeGraphs:
    graphs = capture_decode_graphs(runner, MAX_NUM_SEQS, MAX_MODEL_LEN, backend=FakeGraphs())
    assert graphs is not None
    runner.graphs = graphs
    return graphs


@pytest.fixture
def triton_runner(tiny_model) -> ModelRunner:
    """The runner on the Triton kernels (interpreted on the CPU): the captured launch covers
    max_model_len, whatever the context, and reads the tables only up to each row's context."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels are compiled in this process (no CPU run)")
    model = tiny_model("llama", num_hidden_layers=2)
    return ModelRunner(runner_config(model, num_blocks=64, block_size=BLOCK,
                                     attention_backend="triton",
                                     limits=StepLimits(256, MAX_NUM_SEQS, MAX_MODEL_LEN)),
                       torch.device("cpu"))


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_replayed_decodes_equal_eager_ones(kernels, request) -> None:
    runner = request.getfixturevalue("runner" if kernels == "torch" else "triton_runner")
    assert runner.model.kernels.name == kernels
    eager = _generate(runner, first_block=0)
    graphs = _capture(runner)
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    replayed = _generate(runner, first_block=32)
    # Probe: the decode steps were replayed (3 at size 4, then 2 at size 2), the prefill not.
    assert graphs.replays == DECODE_STEPS
    assert replayed == eager


def test_an_input_that_bypasses_the_buffers_changes_the_tokens(runner, monkeypatch) -> None:
    eager = _generate(runner, first_block=0)
    _capture(runner)
    bypass_the_position_buffer(monkeypatch)
    assert _generate(runner, first_block=32) != eager


def test_steps_that_do_not_fit_a_graph_run_eager(runner) -> None:
    graphs = _capture(runner)
    decode = _request(0, [5], 20, 0)

    def size(requests: list[ScheduledRequest], preemptible: bool = False) -> int | None:
        return graphs.size_for(SchedulerOutput(step_id=1, requests=requests,
                                               preemptible=preemptible))

    assert size([decode] * 3) == 4
    assert size([decode], preemptible=True) is None  # a vote to cast
    assert size([decode, _request(1, [5, 6], 0, 8)]) is None  # a prefill chunk
    resumed = _request(1, [5], 20, 8)
    resumed.resume = True
    assert size([resumed]) is None
    assert size([decode] * (MAX_NUM_SEQS + 1)) is None  # larger than the largest size
    runner.buffers.reserve(10_000, 1, 1)  # the buffers moved: the graphs read old addresses
    assert size([decode]) is None


def test_graphs_are_off_under_enforce_eager_and_on_the_cpu(tiny_model, runner) -> None:
    assert capture_decode_graphs(runner, MAX_NUM_SEQS, MAX_MODEL_LEN) is None  # the CPU
    model = tiny_model("llama", num_hidden_layers=2)
    eager = ModelRunner(runner_config(model, num_blocks=8, block_size=BLOCK, enforce_eager=True),
                        torch.device("cpu"))
    backend = FakeGraphs()
    assert capture_decode_graphs(eager, MAX_NUM_SEQS, MAX_MODEL_LEN, backend=backend) is None
    assert backend.captured == []
    # Tensor parallel on CUDA: off too (before anything touches the GPU).
    from types import SimpleNamespace

    tp_rank = SimpleNamespace(device=torch.device("cuda", 0), enforce_eager=False)
    assert capture_decode_graphs(tp_rank, MAX_NUM_SEQS, MAX_MODEL_LEN, tp_size=2) is None


def test_the_cuda_backend_warms_up_on_a_side_stream_then_captures_into_one_pool(
        monkeypatch) -> None:
    """CudaGraphBackend's calls into torch.cuda, in order, with torch.cuda faked (no GPU)."""
    from contextlib import contextmanager

    from workers.graphs.cuda_graphs import CudaGraphBackend

    calls: list[str] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: Stream) -> None:
            calls.append(f"{self.name} waits for {other.name}")

    class Graph:
        def replay(self) -> None:
            calls.append("replay")

    @contextmanager
    def on_stream(stream: Stream):
        calls.append(f"enter {stream.name}")
        yield
        calls.append(f"leave {stream.name}")

    real_empty_cache = torch.cuda.empty_cache

    @contextmanager
    def capturing(graph: Graph, pool: object):
        # torch.cuda.graph empties the caches here: the backend lets only the first capture.
        flush = torch.cuda.empty_cache is real_empty_cache
        calls.append(f"capture into {pool}" + (" after a cache flush" if flush else ""))
        yield
        calls.append("end capture")

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(cuda, "Stream", lambda device: Stream("side"))
    monkeypatch.setattr(cuda, "current_stream", lambda device: Stream("main"))
    monkeypatch.setattr(cuda, "stream", on_stream)
    monkeypatch.setattr(cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(cuda, "graph", capturing)

    backend = CudaGraphBackend(torch.device("cuda", 0), warmup_runs=2)

    def forward() -> torch.Tensor:
        calls.append("forward")
        return torch.zeros(1)

    for _ in range(2):  # two sizes share the pool
        graph, out = backend.capture(forward)
        assert isinstance(graph, Graph) and out.shape == (1,)
    backend.replay(graph)
    one = ["side waits for main", "enter side", "forward", "forward", "leave side",
           "main waits for side", "capture into pool", "forward", "end capture"]
    first = one[:6] + ["capture into pool after a cache flush"] + one[7:]
    assert calls == first + one + ["replay"]
    assert torch.cuda.empty_cache is real_empty_cache  # restored after each capture


def test_a_failed_capture_is_a_startup_error_naming_the_size_and_the_way_out(runner) -> None:
    class FailingGraphs(FakeGraphs):
        def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
            if self.captured:  # the largest size captures, the next one fails
                raise RuntimeError("operation not permitted when stream is capturing")
            return super().capture(fn)

    backend = FailingGraphs()
    with pytest.raises(RuntimeError, match=r"capture failed at decode batch 4: RuntimeError: "
                       r"operation not permitted .*--enforce-eager"):
        capture_decode_graphs(runner, MAX_NUM_SEQS, MAX_MODEL_LEN, backend=backend)
    assert backend.captured == [8]  # probe: the capture really ran, largest size first
