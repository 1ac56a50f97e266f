"""The attention-op vote on a real forward pass (TP=1): stale signals, Rule 2, no vote on
non-preemptible steps, and the structured PREEMPTED status."""

import pytest
import torch

from engine.model_setup import load_hf_config
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest, SchedulerOutput, StepStatus
from monitor.preempt_signal import NO_TARGET, PreemptSignal
from workers.model_runner import ModelRunner
from workers.preempt_vote import PreemptVote

NUM_LAYERS = 20


@pytest.fixture(scope="module")
def runner(tiny_model):
    model = tiny_model("llama", num_hidden_layers=NUM_LAYERS)
    return ModelRunner(model, load_hf_config(model), torch.float32, torch.device("cpu"),
                       num_blocks=16, block_size=16)


@pytest.fixture
def signal():
    sig = PreemptSignal.create()
    yield sig
    sig.close()


def _step(step_id: int, preemptible: bool = True) -> SchedulerOutput:
    request = ScheduledRequest(req_id="a", token_ids=list(range(1, 41)), start_pos=0,
                               block_ids=[0, 1, 2], sample=True,
                               sampling_params=SamplingParams(temperature=0))
    return SchedulerOutput(step_id=step_id, requests=[request], preemptible=preemptible)


class LayerSpy:
    """Counts the layers the vote saw, and can publish the target once a layer is reached."""

    def __init__(self, vote: PreemptVote, signal: PreemptSignal, publish_at: int | None,
                 target: int) -> None:
        self.vote, self.signal, self.publish_at, self.target = vote, signal, publish_at, target
        self.layers: list[int] = []

    @property
    def step_id(self) -> int:
        return self.vote.step_id

    @step_id.setter
    def step_id(self, value: int) -> None:
        self.vote.step_id = value

    def __call__(self, layer: int) -> None:
        self.layers.append(layer)
        if layer == self.publish_at:
            self.signal.publish(self.target, "victim", "waiter", 0.0)
        self.vote(layer)


def _run(runner, signal, step_id, *, target=NO_TARGET, publish_at=None, preemptible=True):
    vote = PreemptVote(signal, NUM_LAYERS, stubborn_fraction=0.9)
    signal.publish(NO_TARGET if publish_at is not None else target, "", "", 0.0)
    spy = LayerSpy(vote, signal, publish_at, target)
    runner.vote = spy  # the runner installs whatever it is given as the before-attention hook
    out = runner.execute(_step(step_id, preemptible))
    return out, spy.layers


def test_target_for_this_step_unwinds_at_the_next_layer(runner, signal):
    out, layers = _run(runner, signal, step_id=5, target=5, publish_at=3)
    assert out.status is StepStatus.PREEMPTED and out.preempted_layer == 3
    assert layers == [0, 1, 2, 3] and out.sampled_token_ids == {}


def test_stale_target_never_stops_a_later_step(runner, signal):
    # The monitor decided to stop step 5, but step 5 ended before the vote saw it; step 6 runs.
    out, layers = _run(runner, signal, step_id=6, target=5, publish_at=0)
    assert out.status is StepStatus.OK and "a" in out.sampled_token_ids
    assert layers == list(range(NUM_LAYERS))


def test_rule_two_past_the_stubborn_fraction_the_step_completes(runner, signal):
    # 19 / 20 = 0.95 > 0.9: the target arrives too late to stop this step.
    out, layers = _run(runner, signal, step_id=7, target=7, publish_at=19)
    assert out.status is StepStatus.OK and layers[-1] == 19
    # At exactly 90% (layer 18 of 20) it still stops.
    out, _ = _run(runner, signal, step_id=8, target=8, publish_at=18)
    assert out.status is StepStatus.PREEMPTED and out.preempted_layer == 18


def test_non_preemptible_steps_never_vote(runner, signal):
    out, layers = _run(runner, signal, step_id=9, target=9, preemptible=False)
    assert out.status is StepStatus.OK and layers == []
    assert runner.model.before_attention is None


def test_unwound_step_output_matches_a_clean_rerun(runner, signal):
    clean, _ = _run(runner, signal, step_id=10)
    stopped, _ = _run(runner, signal, step_id=11, target=11, publish_at=10)
    assert stopped.status is StepStatus.PREEMPTED
    rerun, _ = _run(runner, signal, step_id=12)
    assert rerun.sampled_token_ids == clean.sampled_token_ids
