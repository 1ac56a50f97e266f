"""Steps that ran only some of the layers as points of the TTFT step model: an unwound step (every
chunk stopped before layer L) and a step resuming suspended passes (each resumed chunk from the
layer it joined at) are scaled by the share of the layers each chunk ran."""

from __future__ import annotations

import pytest

from engine.core.scheduler_output import (ModelRunnerOutput, ScheduledRequest, SchedulerOutput,
                                          StepStatus)
from engine.runtime.step_observation import layers_run
from engine.sampling_params import SamplingParams
from monitor.predictor import StepTimePredictor
from monitor.step_point import StepPoint, step_point
from monitor.step_time_model import StepTimeModel
# The 4-layer engine (the `engine` fixture, tests/core/conftest.py) whose first step a stand-in
# vote unwinds at layer 2.
from tests.utils.engine_steps import _request, _suspend_first_step

TRUTH = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.03, seconds_per_token_sq=2e-7,
                      seconds_per_decode_context=1e-5)


def test_each_chunk_counts_the_share_of_the_layers_it_ran():
    # 30 layers, unwound before layer 10: a fresh 300-token prompt and a decode over 99
    # tokens each ran a third of them.
    point = step_point([(0, 300, 0, 10), (99, 1, 0, 10)], num_layers=30, seconds=0.2)
    assert point == pytest.approx(StepPoint(tokens=301 / 3, attention=300 * 300 / 3,
                                            decode_context=100 / 3, seconds=0.2, share=1 / 3))
    # A resumed chunk (100 tokens over a 200-token prefix, joining at 20) beside a fresh one.
    point = step_point([(200, 100, 20, 30), (0, 50, 0, 30)], num_layers=30, seconds=0.1)
    assert point == pytest.approx(StepPoint(100 / 3 + 50, 100 * 500 / 3 + 2500, 0, 0.1, 1.0))
    # Only resumed chunks: the step ran layers 20..30, and so did its per-step cost.
    assert step_point([(0, 64, 20, 30)], 30, 0.05).share == pytest.approx(1 / 3)
    # A resumed chunk the stop came before ran nothing; a step where nothing ran is no point.
    assert step_point([(0, 64, 20, 20), (0, 32, 0, 10)], 30, 0.05) == \
        pytest.approx(StepPoint(32 / 3, 32 * 32 / 3, 0, 0.05, 1 / 3))
    assert step_point([(0, 64, 0, 0)], 30, 0.05) is None


def _scheduled(req_id: str, start: int, n: int, resume: bool = False) -> ScheduledRequest:
    return ScheduledRequest(req_id=req_id, token_ids=[1] * n, start_pos=start, block_ids=[],
                            sample=False, sampling_params=SamplingParams(), resume=resume)


def test_a_scheduler_output_and_the_runner_s_layers_make_the_point():
    output = SchedulerOutput(step_id=7, requests=[
        _scheduled("fresh", 0, 300), _scheduled("resumed", 200, 100, resume=True),
        _scheduled("decode", 99, 1)])
    unwound = ModelRunnerOutput(step_id=7, status=StepStatus.SLO_PREEMPTED, slo_preempted_layer=25,
                                resumed_layers={"resumed": 20}, execute_seconds=0.4)
    layers = layers_run(output, unwound, num_layers=30)
    assert layers == {"fresh": (0, 25), "resumed": (20, 25), "decode": (0, 25)}
    point = output.step_point(0.4, 30, layers)
    assert point == step_point([(0, 300, 0, 25), (200, 100, 20, 25), (99, 1, 0, 25)], 30, 0.4)
    completed = ModelRunnerOutput(step_id=7, resumed_layers={"resumed": 20})
    assert layers_run(output, completed, 30)["resumed"] == (20, 30)
    # Probe: a completed step of fresh chunks is the whole-step point the engine always used.
    whole = SchedulerOutput(step_id=8, requests=[_scheduled("a", 0, 300), _scheduled("d", 99, 1)])
    assert whole.step_point(0.3, 30, {}) == StepPoint(
        whole.num_scheduled_tokens, whole.attention_work, whole.decode_context, 0.3)
    # An executor that does not report a resumed chunk's layer: the step is not a point.
    assert layers_run(output, ModelRunnerOutput(step_id=7), 30) is None


def test_partial_steps_of_a_known_model_fit_that_model():
    online = StepTimePredictor(StepTimeModel(), refit_every=1)
    shapes = [(0, 128), (0, 512), (256, 256), (0, 1024), (1024, 512), (0, 2048)]
    for i, (prefix, n) in enumerate(shapes * 3):
        start, end = [(0, 30), (0, 10 + i % 15), (5 + i % 20, 30)][i % 3]
        chunks = [(prefix, n, start, end), (100 + 97 * i, 1, 0, end)]
        shape = step_point(chunks, 30, 1.0)
        online.observe_point(shape._replace(seconds=TRUTH.predict_point(shape)))
    model = online.current
    assert model.seconds_per_token == pytest.approx(1e-3, rel=1e-6)
    assert model.seconds_per_token_sq == pytest.approx(2e-7, rel=1e-6)
    assert model.seconds_per_decode_context == pytest.approx(1e-5, rel=1e-6)
    assert model.intercept_s == pytest.approx(0.03, rel=1e-6)


def test_the_engine_observes_unwound_and_resumed_steps(engine):
    engine.add_request(_request("long", 64, seed=1))
    online = engine.step_time_predictor
    _suspend_first_step(engine)  # unwound before layer 2 (of 4): layers 0 and 1 ran
    # Probe: suspended.
    assert engine.scheduler.slack.suspensions.suspended == {"long": [(0, 64, 2)]}
    unwound = online._recent[-1]
    assert (unwound.tokens, unwound.attention, unwound.share) == (32, 64 * 64 / 2, 0.5)
    (output,) = engine.step()  # resumes at layer 2: layers 2 and 3 ran
    assert output.new_token_ids
    resumed = online._recent[-1]
    assert resumed is not unwound
    assert (resumed.tokens, resumed.attention, resumed.share) == (32, 64 * 64 / 2, 0.5)
    engine.step()  # a decode of all layers
    assert online._decode_points[-1].share == 1.0
