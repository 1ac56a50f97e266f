"""Suspended passes on the model runner (mode `suspend`): a prefill chunk whose pass was
unwound between two layers resumes at that layer from the activations the runner kept, and its
logits equal those of an uninterrupted pass, whatever else shares the steps (fresh chunks,
decodes, a second unwind before or after the chunk joined), on a dense model and on a mixture
of experts. Every scenario runs eager and with
the steps replayed as pieces between the attention ops (workers.graphs.piecewise_graphs, through the
CPU stand-in for CUDA graphs): a stop there must suspend the same activations."""

from __future__ import annotations

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput, StepStatus
from workers.model_runner import ModelRunner
from tests.utils.paged_helpers import StopAt
from workers.graphs.cuda_graphs import EagerReplayBackend
from workers.graphs.piecewise_graphs import capture_piecewise_graphs
from workers.step_buffers import StepLimits
from tests.utils.runner_configs import runner_config

NUM_LAYERS = 8
BLOCK = 16


@pytest.fixture(scope="module", params=[("llama", "eager"), ("llama", "piecewise"),
                                        ("qwen3_moe", "eager"), ("qwen3_moe", "piecewise")],
                ids=lambda param: "-".join(param))
def runner(tiny_model, request) -> ModelRunner:
    arch, replay = request.param
    model = tiny_model(arch, num_hidden_layers=NUM_LAYERS)
    runner = ModelRunner(runner_config(model, num_blocks=64, block_size=BLOCK,
                                       limits=StepLimits(128, 4, 128)), torch.device("cpu"))
    if replay == "piecewise":
        runner.piecewise = capture_piecewise_graphs(runner, 128, EagerReplayBackend())
    return runner


@pytest.fixture
def logits(runner: ModelRunner, monkeypatch) -> dict[str, torch.Tensor]:
    """Captures each step's logits by request id (rows of the sampled requests in order)."""
    captured: dict[str, torch.Tensor] = {}
    compute = runner.model.compute_logits
    order: list[list[str]] = []

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        out = compute(hidden)
        for req_id, row in zip(order[-1], out):
            captured[req_id] = row
        return out

    original = runner.prepare_inputs

    def prepare(requests, **kwargs):
        inputs = original(requests, **kwargs)
        order.append([r.req_id for r in inputs.sampled])
        return inputs

    monkeypatch.setattr(runner.model, "compute_logits", spy)
    monkeypatch.setattr(runner, "prepare_inputs", prepare)
    return captured


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = {"a": _prompt(40, 1), "b": _prompt(30, 2), "c": _prompt(50, 3)}


def _chunk(req_id: str, first_block: int, resume: bool = False) -> ScheduledRequest:
    tokens = PROMPTS[req_id]
    blocks = list(range(first_block, first_block + -(-len(tokens) // BLOCK)))
    return ScheduledRequest(req_id=req_id, token_ids=tokens, start_pos=0, block_ids=blocks,
                            sample=True, sampling_params=SamplingParams(temperature=0),
                            resume=resume)


_step_ids = iter(range(1, 1_000_000))


def _execute(runner: ModelRunner, requests: list[ScheduledRequest], stop_at: int | None = None,
             free: list[str] | None = None):
    step_id = next(_step_ids)
    runner.vote = StopAt(stop_at) if stop_at is not None else None
    pieces = runner.piecewise
    unwinds = pieces.unwinds if pieces is not None else 0
    out = runner.execute(SchedulerOutput(step_id=step_id, requests=requests,
                                         preemptible=stop_at is not None,
                                         suspend_on_unwind=stop_at is not None,
                                         free_suspended=free or []))
    runner.vote = None
    if pieces is not None and stop_at is not None and not any(r.resume for r in requests):
        # Probe: the step ran as pieces and the stop came between two of them.
        assert pieces.unwinds == unwinds + 1
    return out


@pytest.fixture(scope="module")
def reference(runner: ModelRunner) -> dict[str, torch.Tensor]:
    """Logits of uninterrupted passes (blocks 40+ are used by nothing else)."""
    captured: dict[str, torch.Tensor] = {}
    for i, req_id in enumerate(PROMPTS):
        inputs = runner.prepare_inputs([_chunk(req_id, 40 + 4 * i)])
        hidden = runner.model.forward(inputs.input_ids, inputs.positions, inputs.attn_meta,
                                      runner.kv_caches)
        captured[req_id] = runner.model.compute_logits(hidden[inputs.logits_indices])[0]
    return captured


def _assert_matches(logits, reference, *req_ids: str) -> None:
    for req_id in req_ids:
        torch.testing.assert_close(logits[req_id], reference[req_id], rtol=1e-4, atol=1e-4)


def test_resume_at_the_stopped_layer_beside_a_fresh_chunk(runner, logits, reference) -> None:
    out = _execute(runner, [_chunk("a", 0), _chunk("b", 4)], stop_at=3)
    assert out.status is StepStatus.SLO_PREEMPTED and out.slo_preempted_layer == 3
    assert sorted(out.suspended_req_ids) == ["a", "b"]
    # b is recomputed from scratch (the engine frees its activations), a resumes at layer 3.
    out = _execute(runner, [_chunk("b", 4), _chunk("a", 0, resume=True)], free=["b"])
    assert out.status is StepStatus.OK and set(out.sampled_token_ids) == {"a", "b"}
    _assert_matches(logits, reference, "a", "b")
    assert len(runner.suspended) == 0


def test_a_resumed_chunk_unwound_again_keeps_the_later_layer(runner, logits, reference) -> None:
    assert _execute(runner, [_chunk("a", 0)], stop_at=3).suspended_req_ids == ["a"]
    # The resuming step is itself unwound at layer 5, after a joined at 3: both a and the fresh
    # c are now suspended at 5.
    out = _execute(runner, [_chunk("c", 8), _chunk("a", 0, resume=True)], stop_at=5)
    assert out.status is StepStatus.SLO_PREEMPTED
    assert sorted(out.suspended_req_ids) == ["a", "c"]
    assert out.resumed_layers == {"a": 3}  # what the TTFT predictor counts a ran
    assert runner.suspended.layer_of(_chunk("a", 0)) == 5
    out = _execute(runner, [_chunk("a", 0, resume=True), _chunk("c", 8, resume=True)])
    assert out.status is StepStatus.OK and out.resumed_layers == {"a": 5, "c": 5}
    _assert_matches(logits, reference, "a", "c")
    assert len(runner.suspended) == 0


def test_unwound_before_joining_keeps_the_old_activations(runner, logits, reference) -> None:
    _execute(runner, [_chunk("a", 0)], stop_at=5)
    # Stopped at layer 2, before a (joining at 5) entered the batch: a keeps its layer-5
    # activations, the fresh b is suspended at 2; the next step joins them at 2 and 5.
    out = _execute(runner, [_chunk("b", 4), _chunk("a", 0, resume=True)], stop_at=2)
    assert sorted(out.suspended_req_ids) == ["a", "b"]
    assert runner.suspended.layer_of(_chunk("a", 0)) == 5
    assert runner.suspended.layer_of(_chunk("b", 4)) == 2
    out = _execute(runner, [_chunk("a", 0, resume=True), _chunk("b", 4, resume=True)])
    assert out.status is StepStatus.OK
    _assert_matches(logits, reference, "a", "b")


def test_stopped_before_the_first_layer_keeps_nothing(runner) -> None:
    out = _execute(runner, [_chunk("a", 0)], stop_at=0)
    assert out.status is StepStatus.SLO_PREEMPTED and out.suspended_req_ids == []
    assert len(runner.suspended) == 0


def _piece(req_id: str, first_block: int, start: int, end: int | None = None,
           resume: bool = True) -> ScheduledRequest:
    """Tokens [start, end) of a prompt's chunk; it samples only when it ends the prompt."""
    chunk = _chunk(req_id, first_block, resume=resume)
    end = len(chunk.token_ids) if end is None else end
    chunk.token_ids, chunk.start_pos = chunk.token_ids[start:end], start
    chunk.sample = end == len(PROMPTS[req_id])
    return chunk


def test_a_suspended_chunk_resumes_in_pieces(runner, logits, reference) -> None:
    """The engine resumes a suspended chunk's first tokens only (the rest stays held at its
    layer); each piece attends over the KV the pieces before it wrote: the logits are those of
    an uninterrupted pass, beside a fresh chunk and with a second unwind on a piece."""
    _execute(runner, [_chunk("a", 0)], stop_at=3)
    out = _execute(runner, [_piece("a", 0, 0, 16), _chunk("b", 4)])
    assert out.status is StepStatus.OK and out.resumed_layers == {"a": 3}
    assert runner.suspended.layer_of(_piece("a", 0, 16)) == 3  # probe: the rest is held
    # The next piece is unwound at layer 6, past its layer: it is held there, ahead of the rest.
    out = _execute(runner, [_piece("a", 0, 16, 24)], stop_at=6)
    assert out.status is StepStatus.SLO_PREEMPTED and out.suspended_req_ids == ["a"]
    assert runner.suspended.layer_of(_piece("a", 0, 16, 24)) == 6
    with pytest.raises(ValueError, match=r"resumes tokens \[16, 40\) but the suspended chunk "
                                         r"is \[16, 24\)"):
        _execute(runner, [_piece("a", 0, 16)])
    out = _execute(runner, [_piece("a", 0, 16, 24)])
    assert out.status is StepStatus.OK and out.resumed_layers == {"a": 6}
    assert runner.suspended.layer_of(_piece("a", 0, 24)) == 3
    out = _execute(runner, [_piece("a", 0, 24)])
    assert out.status is StepStatus.OK and set(out.sampled_token_ids) == {"a"}
    _assert_matches(logits, reference, "a", "b")
    assert len(runner.suspended) == 0


def test_resuming_other_tokens_than_were_suspended_is_an_error(runner) -> None:
    _execute(runner, [_chunk("a", 0)], stop_at=4)
    with pytest.raises(ValueError, match=r"resumes tokens \[8, 40\) but the suspended chunk "
                                         r"is \[0, 40\)"):
        _execute(runner, [_piece("a", 0, 8)])
    with pytest.raises(ValueError, match="did not suspend"):
        _execute(runner, [_chunk("b", 4, resume=True)])
    _execute(runner, [_chunk("b", 4)], free=["a"])
    assert len(runner.suspended) == 0
