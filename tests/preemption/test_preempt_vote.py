"""The attention-op vote on a real forward pass (TP=1): stale signals, Rule 2, no vote on
non-preemptible steps, and the structured PREEMPTED status."""

import multiprocessing as mp

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput, StepStatus
from monitor.slo_preempt_signal import NO_TARGET, SLOPreemptSignal
from workers.distributed import destroy, init_distributed
from workers.model_runner import ModelRunner
from workers.preemption.slo_preempt_vote import SLOPreemptVote, StepSLOPreempted
from tests.utils.runner_configs import runner_config

NUM_LAYERS = 20


@pytest.fixture(scope="module")
def runner(tiny_model):
    model = tiny_model("llama", num_hidden_layers=NUM_LAYERS)
    return ModelRunner(runner_config(model, num_blocks=16, block_size=16), torch.device("cpu"))


@pytest.fixture
def signal():
    sig = SLOPreemptSignal.create()
    yield sig
    sig.close()


def _step(step_id: int, preemptible: bool = True) -> SchedulerOutput:
    request = ScheduledRequest(req_id="a", token_ids=list(range(1, 41)), start_pos=0,
                               block_ids=[0, 1, 2], sample=True,
                               sampling_params=SamplingParams(temperature=0))
    return SchedulerOutput(step_id=step_id, requests=[request], preemptible=preemptible)


class LayerSpy:
    """Counts the layers the vote saw, and can publish the target once a layer is reached."""

    def __init__(self, vote: SLOPreemptVote, signal: SLOPreemptSignal, publish_at: int | None,
                 target: int) -> None:
        self.vote, self.signal, self.publish_at, self.target = vote, signal, publish_at, target
        self.layers: list[int] = []

    @property
    def step_id(self) -> int:
        return self.vote.step_id

    @step_id.setter
    def step_id(self, value: int) -> None:
        self.vote.step_id = value

    def finish(self) -> None:
        self.vote.finish()

    def __call__(self, layer: int) -> None:
        self.layers.append(layer)
        if layer == self.publish_at:
            self.signal.publish(self.target, "victim", "waiter", 0.0)
        self.vote(layer)


def _run(runner, signal, step_id, *, target=NO_TARGET, publish_at=None, preemptible=True):
    vote = SLOPreemptVote(signal, NUM_LAYERS, stubborn_fraction=0.9)
    signal.publish(NO_TARGET if publish_at is not None else target, "", "", 0.0)
    spy = LayerSpy(vote, signal, publish_at, target)
    runner.vote = spy  # the runner installs whatever it is given as the before-attention hook
    out = runner.execute(_step(step_id, preemptible))
    return out, spy.layers


def test_target_for_this_step_unwinds_at_the_next_layer(runner, signal):
    out, layers = _run(runner, signal, step_id=5, target=5, publish_at=3)
    assert out.status is StepStatus.SLO_PREEMPTED and out.slo_preempted_layer == 3
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
    assert out.status is StepStatus.SLO_PREEMPTED and out.slo_preempted_layer == 18


def test_non_preemptible_steps_never_vote(runner, signal):
    out, layers = _run(runner, signal, step_id=9, target=9, preemptible=False)
    assert out.status is StepStatus.OK and layers == []
    assert runner.model.before_attention is None


def test_unwound_step_output_matches_a_clean_rerun(runner, signal):
    clean, _ = _run(runner, signal, step_id=10)
    stopped, _ = _run(runner, signal, step_id=11, target=11, publish_at=10)
    assert stopped.status is StepStatus.SLO_PREEMPTED
    rerun, _ = _run(runner, signal, step_id=12)
    assert rerun.sampled_token_ids == clean.sampled_token_ids


def _vote_rank(rank: int, store_dir: str, signal_name: str, results) -> None:
    groups = init_distributed(rank, 2, f"file://{store_dir}/store", torch.device("cpu"),
                              timeout_s=120)
    try:
        # Rank 1 has no view of the signal (as on another node): it votes 0 and learns the
        # outcome from the collective.
        signal = SLOPreemptSignal.attach(signal_name) if rank == 0 else None
        vote = SLOPreemptVote(signal, num_layers=10, stubborn_fraction=0.85,
                           cpu_group=groups.cpu_group)
        outcomes = []
        for step_id in (7, 8):  # step 7 is the target; step 8 must run to its end
            vote.step_id = step_id
            stopped_at = None
            try:
                for layer in range(10):
                    if rank == 0 and step_id == 7 and layer == 3:
                        signal.publish(7, "victim", "waiter", 0.0)
                    vote(layer)
                vote.finish()
            except StepSLOPreempted as stop:
                stopped_at = stop.layer
            outcomes.append(stopped_at)
        results.put((rank, outcomes, vote.stats.collectives))
        if signal is not None:
            signal.close()
    finally:
        destroy(groups)


def test_tp_vote_ranks_unwind_together_one_layer_after_the_ballot(tmp_path):
    """Two gloo ranks: the ballot of layer 3 (set on rank 0 only) stops both ranks at the
    boundary of layer 4; a later step is not stopped by the stale target; past the stubborn
    fraction (0.85: layer 9 of 10) no ballot is started."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    owner = SLOPreemptSignal.create()
    try:
        procs = [ctx.Process(target=_vote_rank, args=(r, str(tmp_path), owner.name, results))
                 for r in range(2)]
        for p in procs:
            p.start()
        got = dict((rank, (outcomes, n)) for rank, outcomes, n in
                   (results.get(timeout=60) for _ in procs))
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        owner.close()
    # Step 7: ballots at layers 0..3, stop at 4. Step 8: ballots at layers 0..8 (9/10 > 0.85).
    assert got == {0: ([4, None], 4 + 9), 1: ([4, None], 4 + 9)}
