"""Steps with prefill tokens replayed as pieces between the attention ops
(workers.graphs.piecewise_graphs), checked on the CPU through EagerReplayBackend: a "replay" runs the
captured piece again with no arguments, so the tokens equal an eager run's only if every value
crossing a piece boundary went through the static buffers (a probe plants an input that
bypasses them and sees the tokens change). Stops between pieces are in tests/preemption/test_suspend.py,
which runs every scenario with the pieces on too."""

from __future__ import annotations

import pytest
import torch

import tests.utils.triton_device  # noqa: F401  (Triton's interpreter, before any kernels.triton_*)
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.sampling_params import SamplingParams
from tests.utils.paged_helpers import StopAt, bypass_the_position_buffer
from workers.graphs.cuda_graphs import EagerReplayBackend
from workers.model_runner import ModelRunner
from workers.graphs.piecewise_graphs import PiecewiseGraphs, capture_piecewise_graphs
from workers.step_buffers import StepLimits
from tests.utils.runner_configs import runner_config

BLOCK = 16
MAX_MODEL_LEN = 128
MAX_TOKENS = 64
CHUNK = 16
NEW_TOKENS = 5


class CountingBackend(EagerReplayBackend):
    def __init__(self) -> None:
        self.captured = 0

    def capture(self, fn):
        self.captured += 1
        return super().capture(fn)


class TrappedBackend(CountingBackend):
    """Knows when a captured piece runs (``inside``), at capture and at every replay."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = False

    def capture(self, fn):
        def piece():
            self.inside = True
            try:
                return fn()
            finally:
                self.inside = False
        return super().capture(piece)


def _runner(tiny_model, kernels: str = "torch") -> ModelRunner:
    model = tiny_model("llama", num_hidden_layers=3)
    return ModelRunner(runner_config(model, num_blocks=64, block_size=BLOCK,
                                     attention_backend=kernels,
                                     limits=StepLimits(MAX_TOKENS, 8, MAX_MODEL_LEN)),
                       torch.device("cpu"))


@pytest.fixture
def runner(tiny_model) -> ModelRunner:
    return _runner(tiny_model)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_prompt(20, 1), _prompt(35, 2), _prompt(9, 3)]
_greedy = SamplingParams(temperature=0)


def _generate(runner: ModelRunner, first_block: int,
              preemptible: bool = False) -> dict[str, list[int]]:
    """Greedy, chunked: each step gives every request its next chunk of at most CHUNK prompt
    tokens, or its next decode; the steps mix chunks and decodes of 1 to 41 tokens. A
    ``preemptible`` step with prefill tokens casts the runner's vote (``runner.vote``)."""
    computed = [0] * len(PROMPTS)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    step_id = 0
    while any(len(t) < NEW_TOKENS for t in tokens.values()):
        requests = []
        for i, prompt in enumerate(PROMPTS):
            out = tokens[f"r{i}"]
            if len(out) >= NEW_TOKENS:
                continue
            if computed[i] < len(prompt):
                chunk = prompt[computed[i]:computed[i] + CHUNK]
            else:
                chunk = [out[-1]]
            start = computed[i]
            end = start + len(chunk)
            blocks = list(range(first_block + 8 * i, first_block + 8 * i + -(-end // BLOCK)))
            requests.append(ScheduledRequest(
                req_id=f"r{i}", token_ids=chunk, start_pos=start, block_ids=blocks,
                sample=end >= len(prompt), sampling_params=_greedy))
            computed[i] = end
        step_id += 1
        votes = preemptible and any(len(r.token_ids) > 1 for r in requests)
        result = runner.execute(SchedulerOutput(step_id=step_id, requests=requests,
                                                preemptible=votes))
        assert not result.failed
        for request in requests:
            if request.sample:
                tokens[request.req_id].append(result.sampled_token_ids[request.req_id])
    return tokens


def _capture(runner: ModelRunner, backend: EagerReplayBackend | None = None) -> PiecewiseGraphs:
    runner.piecewise = capture_piecewise_graphs(runner, MAX_TOKENS,
                                                backend or EagerReplayBackend())
    return runner.piecewise


def test_replayed_pieces_equal_an_eager_pass(tiny_model) -> None:
    runner = _runner(tiny_model)
    eager = _generate(runner, first_block=0)
    backend = CountingBackend()
    pieces = _capture(runner, backend)
    assert pieces.sizes == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    # One piece per layer boundary (3 layers: 4 pieces) for every size; with the PyTorch
    # kernels the attention runs eager between them, and no step is captured whole.
    assert not pieces.holds_attention
    assert backend.captured == 4 * len(pieces.sizes)
    replayed = _generate(runner, first_block=24)
    # Probe: every step was replayed (no decode graphs here, so decode-only steps too).
    assert pieces.replays > len(PROMPTS) and pieces.whole_replays == 0
    assert replayed == eager


def test_pieces_holding_the_attention_equal_an_eager_pass(tiny_model, monkeypatch) -> None:
    """Triton (interpreted): the attention (KV write and kernel) runs inside the pieces,
    reading the step's layout on the device, and only the vote between them. Steps with no
    vote replay each size's pieces as one whole graph, steps that vote piece by piece; both
    give the eager tokens, and a stop still unwinds between two pieces."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels are compiled in this process (no CPU run)")
    runner = _runner(tiny_model, "triton")
    eager = _generate(runner, first_block=0)
    backend = TrappedBackend()
    attended: list[bool] = []
    attend = runner.model.attend

    def watched_attend(*args, **kwargs):
        attended.append(backend.inside)
        return attend(*args, **kwargs)

    monkeypatch.setattr(runner.model, "attend", watched_attend)
    pieces = _capture(runner, backend)
    assert pieces.holds_attention
    assert backend.captured == 5 * len(pieces.sizes)  # 4 pieces and the whole step, per size

    # No vote: every step whole.
    assert _generate(runner, first_block=24) == eager
    assert pieces.replays > len(PROMPTS) and pieces.whole_replays == pieces.replays

    votes: list[tuple[int, bool]] = []

    class Vote(StopAt):
        def __call__(self, layer: int) -> None:
            votes.append((layer, backend.inside))
            super().__call__(layer)

    runner.vote = Vote(None)
    attended.clear()
    whole = pieces.whole_replays
    assert _generate(runner, first_block=24, preemptible=True) == eager
    # Probes: the steps with prefill tokens ran piece by piece (the decode-only ones whole),
    # the vote outside every piece at every layer, the attention inside a piece.
    assert pieces.replays - pieces.whole_replays > 0 and pieces.whole_replays > whole
    assert {layer for layer, _ in votes} == {0, 1, 2}
    assert not any(inside for _, inside in votes)
    assert attended and all(attended)

    # A stop before layer 1's attention unwinds the replayed step there.
    runner.vote = Vote(1)
    chunk = ScheduledRequest(req_id="p", token_ids=PROMPTS[1][:CHUNK], start_pos=0,
                             block_ids=[40], sample=False, sampling_params=_greedy)
    unwinds = pieces.unwinds
    out = runner.execute(SchedulerOutput(step_id=99, requests=[chunk], preemptible=True))
    assert out.status.name == "SLO_PREEMPTED" and out.slo_preempted_layer == 1
    assert pieces.unwinds == unwinds + 1


def test_qwen3_qk_norm_pieces_equal_an_eager_pass(tiny_model) -> None:
    model = tiny_model("qwen3", num_hidden_layers=2)
    runner = ModelRunner(runner_config(model, num_blocks=64, block_size=BLOCK,
                                       limits=StepLimits(MAX_TOKENS, 8, MAX_MODEL_LEN)),
                         torch.device("cpu"))
    eager = _generate(runner, first_block=0)
    _capture(runner)
    assert _generate(runner, first_block=24) == eager


def test_an_input_that_bypasses_the_buffers_changes_the_tokens(runner, monkeypatch) -> None:
    eager = _generate(runner, first_block=0)
    _capture(runner)
    bypass_the_position_buffer(monkeypatch)
    assert _generate(runner, first_block=24) != eager


def test_the_vote_runs_between_the_pieces(runner) -> None:
    """A stop before layer 1's attention op unwinds a replayed step at that layer."""
    pieces = _capture(runner)
    votes: list[int] = []

    class Recording(StopAt):
        def __call__(self, layer: int) -> None:
            votes.append(layer)
            super().__call__(layer)

    runner.vote = Recording(1)
    prompt = PROMPTS[1][:CHUNK]
    chunk = ScheduledRequest(req_id="p", token_ids=prompt, start_pos=0, block_ids=[0],
                             sample=False, sampling_params=_greedy)
    out = runner.execute(SchedulerOutput(step_id=1, requests=[chunk], preemptible=True))
    assert out.status.name == "SLO_PREEMPTED" and out.slo_preempted_layer == 1
    assert votes == [0, 1]
    assert pieces.replays == 0  # unwound, not finished
    assert runner.model.before_attention is None


def test_steps_that_do_not_fit_the_pieces_run_eager(runner) -> None:
    pieces = _capture(runner)

    def size(requests: list[ScheduledRequest]) -> int | None:
        return pieces.size_for(SchedulerOutput(step_id=1, requests=requests))

    def chunk(n: int, resume: bool = False) -> ScheduledRequest:
        return ScheduledRequest(req_id=f"c{n}", token_ids=[5] * n, start_pos=0,
                                block_ids=[0, 1, 2, 3], sample=False, sampling_params=_greedy,
                                resume=resume)

    assert size([chunk(17)]) == 24
    assert size([chunk(9), chunk(1)]) == 16
    assert size([chunk(MAX_TOKENS)]) == MAX_TOKENS
    assert size([chunk(20, resume=True)]) is None  # joins mid-pass: the row count changes
    assert size([chunk(MAX_TOKENS), chunk(1)]) is None  # larger than the largest size
    runner.buffers.reserve(10_000, 1, 1)  # the buffers moved: the pieces read old addresses
    assert size([chunk(3)]) is None
    assert pieces.graphs == {}


def test_no_piece_spans_an_attention_op_or_the_vote(runner, monkeypatch) -> None:
    """docs/design.md section 9: no graph spans an attention op of a preemptible step (the vote
    lives there). Every piece, captured and replayed, runs with the attention op and the vote
    hook booby-trapped; the step between the replays calls both, once per layer."""
    calls: list[str] = []
    trapped = TrappedBackend()
    attention_op = runner.model.attention_op

    def watched_attention(layer, *args, **kwargs):
        assert not trapped.inside, f"layer {layer}'s attention op ran inside a piece"
        calls.append(f"attention {layer}")
        return attention_op(layer, *args, **kwargs)

    monkeypatch.setattr(runner.model, "attention_op", watched_attention)
    _capture(runner, trapped)

    class Vote(StopAt):
        def __call__(self, layer: int) -> None:
            assert not trapped.inside, f"the vote of layer {layer} ran inside a piece"
            calls.append(f"vote {layer}")

    runner.vote = Vote(None)
    chunk = ScheduledRequest(req_id="p", token_ids=PROMPTS[1][:CHUNK], start_pos=0,
                             block_ids=[0], sample=True, sampling_params=_greedy)
    out = runner.execute(SchedulerOutput(step_id=1, requests=[chunk], preemptible=True))
    assert out.status.name == "OK" and runner.piecewise.replays == 1  # probe: it ran as pieces
    # The attention op's first act is the vote.
    assert calls == [f"{kind} {layer}" for layer in range(3) for kind in ("attention", "vote")]
