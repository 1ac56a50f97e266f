"""No host syncs inside the decoder layers (the groundwork of CUDA graphs).

Steps of every kind run on the CPU with a tiny model under ``tests.utils.host_sync.HostSyncDetector``:
prefill-only, decode-only, mixed, a chunk over a cached prefix, a preemptible step unwound by the
vote (its prefill suspended) and the step that resumes it. Nothing between entering the first
decoder layer and leaving the last may read a tensor's value on the host, except the vote and
the run-ahead pacing at the attention boundary (exempt by name; the tests check they ran).
The Triton backend's host side runs with its kernel launches stubbed out: what the launches
compute is the device's business, the arguments built for them are the host's.
"""

from __future__ import annotations

import pytest
import torch

import tests.utils.triton_device  # noqa: F401  (Triton's interpreter, before any kernels.triton_*)
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput, StepStatus
from engine.sampling_params import SamplingParams
from tests.utils.host_sync import SYNCING_METHODS, HostSyncDetector
from workers.model_runner import ModelRunner
from workers.preemption.slo_preempt_vote import SLOPreemptVote
from workers.preemption.run_ahead import RunAheadLimit
from tests.utils.runner_configs import runner_config

NUM_LAYERS = 4
BLOCK = 16
STOP_LAYER = 2


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = {"a": _prompt(40, 1), "b": _prompt(30, 2), "c": _prompt(50, 3), "d": _prompt(20, 4)}
FIRST_BLOCK = {"a": 0, "b": 4, "c": 8, "d": 12}


def _chunk(req_id: str, start: int, end: int, *, resume: bool = False,
           token: int | None = None) -> ScheduledRequest:
    """Tokens start..end of req_id's prompt, or one decode token at position start."""
    tokens = [token] if token is not None else PROMPTS[req_id][start:end]
    length = start + len(tokens)
    first = FIRST_BLOCK[req_id]
    blocks = list(range(first, first + -(-length // BLOCK)))
    return ScheduledRequest(req_id=req_id, token_ids=tokens, start_pos=start, block_ids=blocks,
                            sample=end >= len(PROMPTS[req_id]) or token is not None,
                            sampling_params=SamplingParams(temperature=0), resume=resume)


class _SyncingEvent:
    """A CUDA event stand-in whose wait reads a value back, as cudaEventSynchronize waits."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        torch.ones(1).item()

    def elapsed_time(self, end: "_SyncingEvent") -> float:
        # Long layers (ms): from the third layer on the host waits for each boundary itself.
        return float(torch.tensor(50.0).item())


@pytest.fixture(params=["torch", "triton"])
def runner(request, tiny_model, monkeypatch) -> ModelRunner:
    launches: list[str] = []
    if request.param == "triton":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels are compiled in this process (no CPU run)")
        from kernels import triton_attention, triton_cache

        # The host side of every launch runs; the kernels do not (their arguments are built).
        def stub(kernel, grid, *args, **kwargs) -> None:
            launches.append(getattr(kernel, "__name__", str(kernel)))

        monkeypatch.setattr(triton_attention, "launch", stub)
        monkeypatch.setattr(triton_cache, "launch", stub)
    model = tiny_model("llama", num_hidden_layers=NUM_LAYERS)
    runner = ModelRunner(runner_config(model, num_blocks=64, block_size=BLOCK,
                                       attention_backend=request.param), torch.device("cpu"))
    runner.test_launches = launches  # type: ignore[attr-defined]
    return runner


def _votes(runner: ModelRunner, monkeypatch) -> list[int]:
    """Give the runner the real vote, paced as on a GPU; its local decision reads a value back
    (as the TP ballot does) and stops the step whose id is 5 at STOP_LAYER."""
    cast: list[int] = []

    def local_vote(vote: SLOPreemptVote, layer: int) -> bool:
        cast.append(layer)
        return bool(torch.tensor(vote.step_id == 5 and layer == STOP_LAYER))

    monkeypatch.setattr(SLOPreemptVote, "_local_vote", local_vote)
    runner.vote = SLOPreemptVote(None, NUM_LAYERS)
    runner.run_ahead = RunAheadLimit(window=1, make_event=_SyncingEvent)
    return cast


STEPS: list[tuple[str, list[ScheduledRequest], bool]] = [
    ("prefill", [_chunk("a", 0, 40), _chunk("b", 0, 30)], True),
    ("decode", [_chunk("a", 40, 41, token=7), _chunk("b", 30, 31, token=9)], False),
    ("mixed", [_chunk("a", 41, 42, token=11), _chunk("c", 0, 20)], True),
    ("prefix", [_chunk("b", 31, 32, token=5), _chunk("c", 20, 50)], True),
    ("unwound", [_chunk("a", 42, 43, token=3), _chunk("d", 0, 20)], True),
    ("resumed", [_chunk("b", 32, 33, token=4), _chunk("d", 0, 20, resume=True)], True),
]


def test_no_host_sync_between_the_first_and_the_last_layer(runner, monkeypatch) -> None:
    cast = _votes(runner, monkeypatch)
    statuses = {}
    with HostSyncDetector() as detector:
        detector.watch(runner.model)
        for step_id, (kind, requests, preemptible) in enumerate(STEPS, start=1):
            out = runner.execute(SchedulerOutput(step_id=step_id, requests=requests,
                                                 preemptible=preemptible,
                                                 suspend_on_unwind=preemptible))
            detector.disarm()
            statuses[kind] = out.status
            assert out.error is None, (kind, out.error)
    assert not detector.found, detector.report()
    # Probes: every kind of step ran as meant to, through the layers, with the vote and the
    # pacing (whose read-backs are the exempt ones) at work.
    assert statuses["unwound"] is StepStatus.SLO_PREEMPTED
    assert all(s is StepStatus.OK for kind, s in statuses.items() if kind != "unwound")
    # 5 full passes, one stopped before STOP_LAYER's attention (layers 0..STOP_LAYER entered),
    # and the resumed step's NUM_LAYERS (its decode runs every layer).
    assert detector.layers_entered == 5 * NUM_LAYERS + STOP_LAYER + 1
    assert STOP_LAYER in cast and len(cast) == 4 * NUM_LAYERS + STOP_LAYER + 1
    assert {s.method for s in detector.exempted} >= {"item", "__bool__"}
    if runner.model.kernels.name == "triton":
        assert "_paged_attention_kernel" in runner.test_launches  # type: ignore[attr-defined]


def test_the_detector_catches_a_read_back_planted_in_a_layer(runner) -> None:
    def planted(_module: torch.nn.Module, args: tuple) -> None:
        args[1].sum().item()

    handle = runner.model.model.layers[1].register_forward_pre_hook(planted)
    try:
        with HostSyncDetector() as detector:
            detector.watch(runner.model)
            out = runner.execute(SchedulerOutput(step_id=1, requests=[_chunk("a", 0, 40)]))
    finally:
        handle.remove()
    assert out.status is StepStatus.OK
    assert [s.method for s in detector.found] == ["item"]
    assert any(frame.name == "planted" for frame in detector.found[0].stack)


@pytest.mark.parametrize("read_back", [
    lambda t: t.item(), lambda t: t.tolist(), lambda t: t.cpu(), lambda t: t.numpy(),
    lambda t: int(t), lambda t: float(t), lambda t: bool(t), lambda t: [0, 1, 2][t],
    lambda t: 1 if t else 0,
], ids=["item", "tolist", "cpu", "numpy", "int", "float", "bool", "index", "if"])
def test_each_kind_of_read_back_is_caught_only_while_armed(read_back) -> None:
    value = torch.tensor(1)
    with HostSyncDetector() as detector:
        read_back(value)  # disarmed: not recorded
        detector.armed = True
        read_back(value)
    assert len(detector.found) == 1 and detector.found[0].method in SYNCING_METHODS
    read_back(value)  # the methods are restored
    assert len(detector.found) == 1
