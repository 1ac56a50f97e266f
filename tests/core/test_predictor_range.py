"""The predictor trusts each term only inside the range it was fitted on: past the
longest measured point a term grows by the cost per unit that point implies, not by a slope
that other points determined, and the prediction says it left the range."""

from __future__ import annotations

import json

import pytest

from monitor.predictor import StepTimePredictor
from monitor.step_point import StepPoint
from monitor.step_time_fit import fit_step, with_range
from monitor.step_time_model import StepTimeModel

# The defect: a decode slope of 6e-5 s per KV token, dragged there by other steps, while the
# longest decode measured (259 tokens of context) cost what 3e-5 s per KV token says.
INTERCEPT, PER_TOKEN, TRUE_DECODE = 0.02, 1e-3, 3e-5


def _points() -> list[StepPoint]:
    prompts = [StepPoint(n, n * n, 0, INTERCEPT + PER_TOKEN * n) for n in (16, 64, 256, 1024)]
    decodes = [StepPoint(1, 0, c, INTERCEPT + PER_TOKEN + TRUE_DECODE * c) for c in (17, 65, 259)]
    return prompts + decodes


def _dragged() -> StepTimeModel:
    """The fit with its decode slope doubled (as mixed steps once pushed it), then given the
    range of the points it came from."""
    fitted = fit_step(_points(), quadratic=False, decode=True)
    return with_range(StepTimeModel(seconds_per_token=fitted.seconds_per_token,
                                    intercept_s=fitted.intercept_s,
                                    seconds_per_decode_context=2 * TRUE_DECODE), _points())


def test_the_fit_keeps_the_range_of_its_points():
    model = fit_step(_points(), quadratic=False, decode=True)
    assert model.calibrated_tokens == 1024
    assert model.calibrated_attention == 1024 * 1024
    assert model.calibrated_decode_context == 259
    assert model.seconds_per_decode_context == pytest.approx(TRUE_DECODE)
    # Inside the range nothing changes; an exact fit's edge cost is its coefficient.
    assert model.edge_seconds_per_decode_context == pytest.approx(TRUE_DECODE)
    assert model.extrapolated(105, 105 * 105, 259) == ()
    assert model.extrapolated(105, 105 * 105, 3949) == ("decode_context",)
    assert model.is_extrapolated(2048) and not model.is_extrapolated(1000)
    # Partial steps compare as the whole steps they are shares of.
    assert not model.is_extrapolated(50, 0, 120, share=0.5)
    assert model.is_extrapolated(50, 0, 150, share=0.5)


def test_past_the_range_a_term_grows_by_the_edge_cost_not_the_slope():
    model = _dragged()
    # The longest decode point says 3e-5 per KV token, against the slope's 6e-5.
    assert model.edge_seconds_per_decode_context == pytest.approx(TRUE_DECODE, rel=0.05)
    beside = model.predict(105, 3949)
    slope = (INTERCEPT + PER_TOKEN * 105 + 2 * TRUE_DECODE * 3949)  # what the old code said
    edge = (INTERCEPT + PER_TOKEN * 105 + 2 * TRUE_DECODE * 259
            + TRUE_DECODE * (3949 - 259))
    assert beside == pytest.approx(edge, rel=0.02)
    assert beside < 0.75 * slope
    assert model.is_extrapolated(105, decode_context=3949)
    # Inside the range the fitted slope stands.
    assert model.predict(105, 200) == pytest.approx(INTERCEPT + PER_TOKEN * 105
                                                    + 2 * TRUE_DECODE * 200, rel=1e-6)


def test_budgets_invert_the_edge_cost():
    model = _dragged()
    for seconds in (0.5, 1.0, 3.0):
        n = model.max_tokens_within(seconds, decode_context=3949)
        assert model.predict(n, 3949) <= seconds < model.predict(n + 1, 3949)
        m = model.max_chunk_within(seconds, 1, 0, 3949, prefix=100)
        step = model.predict_step(1 + m, m * (200 + m), 3949)
        assert step <= seconds < model.predict_step(2 + m, (m + 1) * (201 + m), 3949)


def test_old_files_load_and_new_ones_round_trip(tmp_path):
    model = _dragged()
    path = tmp_path / "ttft.json"
    model.save(path)
    assert StepTimeModel.load(path) == model
    data = json.loads(path.read_text())
    for name in ("calibrated_tokens", "calibrated_attention", "calibrated_decode_context",
                 "edge_seconds_per_token", "edge_seconds_per_token_sq",
                 "edge_seconds_per_decode_context"):
        del data[name]
    path.write_text(json.dumps(data))
    old = StepTimeModel.load(path)
    assert not old.has_range and not old.is_extrapolated(1 << 20, decode_context=1 << 20)
    assert old.predict(105, 3949) == pytest.approx(INTERCEPT + PER_TOKEN * 105
                                                   + 2 * TRUE_DECODE * 3949, rel=0.02)
    data["edge_seconds_per_decode_context"] = -1.0
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="edge_seconds_per_decode_context"):
        StepTimeModel.load(path)


def test_online_refits_keep_the_range_of_their_windows():
    online = StepTimePredictor(fit_step(_points(), quadratic=True, decode=True))
    online.reseed(online.current, _points())
    for i in range(16):
        n = (100, 300, 500, 700)[i % 4]
        online.observe(n, INTERCEPT + PER_TOKEN * n)
        online.observe(1, INTERCEPT + PER_TOKEN + TRUE_DECODE * 2000, attention=0,
                       decode_context=2000)
    assert online.current.calibrated_decode_context == 2000
    assert not online.current.is_extrapolated(105, decode_context=2000)


def test_a_servers_step_model_travels_with_its_stats_and_reads_back():
    """/debug/stats' `ttft_model`: the predictor's fields in the scheduler's stats snapshot,
    through the EngineCore -> API server channel (msgspec, typed), and back into a model."""
    import msgspec

    from engine.outputs import SchedulerStats

    model = _dragged()
    stats = SchedulerStats(ttft_model=model.to_dict())
    received = msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=SchedulerStats)
    assert received.ttft_model["confident"] is True
    assert StepTimeModel.from_dict(received.ttft_model) == model
    with pytest.raises(ValueError, match="the server's ttft_model: seconds_per_token"):
        StepTimeModel.from_dict({**model.to_dict(), "seconds_per_token": 0.0},
                                source="the server's ttft_model")
