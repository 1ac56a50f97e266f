"""The deadline caps on a floor-bound device: a GPU's step lasts its floor (30 ms eager on an
H100 for an 8B model) up to some hundreds of tokens, so what fits under the floor joins a step
whose deadline is tight, since holding it out would protect nothing. Each test pairs the step on
a floor model with the same decision on a model without a floor that predicts the same time for
the step as it stands: there the joiner would lengthen the step, and the cap keeps it out."""

from __future__ import annotations

import pytest

from monitor.step_time_model import StepTimeModel
from tests.utils.scheduling import (FakeRunner, _request, frozen_clock,  # noqa: F401
                                    make_scheduler, scheduled)

pytestmark = pytest.mark.usefixtures("frozen_clock")

# The simulated H100's step for an 8B model: 30 ms up to some 860 tokens, then 30 us a token.
FLOOR = StepTimeModel(seconds_per_token=30e-6, intercept_s=0.004, floor_s=0.030)


def _scheduler(model: StepTimeModel):
    sched = make_scheduler(policy="slo", num_blocks=1000, budget=2048, max_num_seqs=8)
    sched.step_time_predictor.current = model
    return sched


@pytest.mark.parametrize("floor_bound", [True, False], ids=["floor", "line"])
def test_a_second_turn_joins_a_tight_turn_s_step_under_the_floor(floor_bound):
    """Turn A (208 tokens) has 38 ms left: its step (30 ms) meets it, but fills more than the
    share of its time a cap may fill. Turn B (448 tokens, 200 ms) arrived with it. On the floor
    model B adds nothing to the step's 30 ms and shares it; before, it waited for the next
    prefill step. The probe: a line predicting A's step at the same 30 ms charges B's tokens,
    and B stays out."""
    model = FLOOR if floor_bound else StepTimeModel(seconds_per_token=0.030 / 210,
                                                    intercept_s=0.0)
    sched = _scheduler(model)
    sched.add_request(_request("A", 208, 38))
    sched.add_request(_request("B", 448, 200))
    chunks = scheduled(sched.schedule())
    assert chunks["A"] == 208
    if floor_bound:
        assert chunks.get("B") == 448
        assert model.predict_step(208 + 448, 0) == pytest.approx(model.predict_step(208, 0))
    else:
        assert "B" not in chunks


@pytest.mark.parametrize("floor_bound", [True, False], ids=["floor", "line"])
def test_a_prefill_joins_a_tight_tpot_decode_under_the_floor(floor_bound):
    """A request decodes with a 35 ms TPOT objective: a step of its decode alone takes 30 ms,
    within the objective but over the share a cap may fill. A relaxed prompt of 500 tokens
    waits. On the floor model it joins the decode's step (30 ms either way); before, every step
    was the decode alone until the stream ended. The probe: on a line the prompt would lengthen
    the step, and only the decode runs."""
    model = FLOOR if floor_bound else StepTimeModel(seconds_per_token=0.030, intercept_s=0.0)
    sched = _scheduler(model)
    runner = FakeRunner(sched)
    stream = _request("stream", 8, None, max_tokens=20)
    stream.tpot_slo_ms = 35.0
    sched.add_request(stream)
    # Its prefill, then a decode: from then on it has a last token and a next-token deadline.
    for _ in range(2):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    assert sched.get_request("stream").last_token_time is not None
    sched.add_request(_request("document", 500, 20_000))
    chunks = scheduled(sched.schedule())
    assert chunks["stream"] == 1
    if floor_bound:
        assert chunks.get("document") == 500
    else:
        assert "document" not in chunks
