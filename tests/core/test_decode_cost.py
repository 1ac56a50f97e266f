"""The step model's decode term: a decode costs in proportion to the KV it reads. Its feature,
its fit (calibrate and online, with a window of its own), and its use by the TPOT cap and by the
slack of a waiter predicted beside the running decodes."""

from __future__ import annotations

import time

import pytest

from engine.config import build_engine_config
from engine.core.request import Request, RequestStatus
from engine.core.request_queue import UrgencyQueue
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.core.slack_policy import SlackPolicy
from engine.runtime.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from monitor.predictor import StepTimePredictor
from monitor.step_point import attention_work, decode_context
from monitor.step_time_fit import fit_step
from monitor.step_time_model import StepTimeModel
from tests.utils.scheduling import make_request, FakeScheduler, _step

TRUE = StepTimeModel(seconds_per_token=2e-3, intercept_s=0.04, seconds_per_token_sq=1e-7,
                     seconds_per_decode_context=2e-5)
_true_time = TRUE.predict_step


def test_decodes_are_their_own_feature_not_attention_work():
    chunks = [(0, 300), (100, 50), (2000, 1), (63, 1)]  # two prefill chunks, two decodes
    assert attention_work(chunks) == 300 * 300 + 50 * (200 + 50)
    assert decode_context(chunks) == 2001 + 64
    output = SchedulerOutput(step_id=1, requests=[
        ScheduledRequest(req_id=str(i), token_ids=[1] * n, start_pos=prefix, block_ids=[],
                         sample=True, sampling_params=SamplingParams())
        for i, (prefix, n) in enumerate(chunks)])
    assert output.attention_work == attention_work(chunks)
    assert output.decode_context == 2065


def test_fit_step_recovers_every_term_of_mixed_steps():
    steps = []
    for tokens in (64, 256, 1024, 2048):
        for context in (0, 4000, 16000):
            attention = tokens * tokens
            steps.append((tokens + 8, attention, context, _true_time(tokens + 8, attention,
                                                                     context)))
    steps += [(b, 0, b * n, _true_time(b, 0, b * n)) for b in (1, 8) for n in (64, 2048)]
    model = fit_step(steps, quadratic=True, decode=True)
    assert model.seconds_per_decode_context == pytest.approx(2e-5, rel=1e-6)
    assert model.seconds_per_token == pytest.approx(2e-3, rel=1e-6)
    assert model.seconds_per_token_sq == pytest.approx(1e-7, rel=1e-6)
    assert model.intercept_s == pytest.approx(0.04, rel=1e-6)


def test_a_decode_term_the_data_contradicts_is_dropped():
    # Decodes cheaper than the prefill line predicts: a negative coefficient means no term.
    steps = [(n, n * n, 0, 0.04 + 2e-3 * n) for n in (64, 512, 2048)]
    steps += [(1, 0, n, 0.03 - 1e-6 * n) for n in (64, 1024, 2048)]
    model = fit_step(steps, quadratic=False, decode=True)
    assert model.seconds_per_decode_context == 0.0
    assert model.seconds_per_token > 0


def test_the_decode_term_survives_save_and_load(tmp_path):
    path = tmp_path / "m.json"
    TRUE.save(path)
    assert StepTimeModel.load(path) == TRUE
    path.write_text('{"seconds_per_token": 0.001, "intercept_s": 0.01, '
                    '"seconds_per_decode_context": -1}')
    with pytest.raises(ValueError, match="seconds_per_decode_context"):
        StepTimeModel.load(path)


def test_max_tokens_within_leaves_the_decodes_their_time():
    line = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.01, seconds_per_decode_context=1e-5)
    assert line.max_tokens_within(0.5) == 490
    assert line.max_tokens_within(0.5, decode_context=20_000) == 290  # 200 ms for the decodes


def test_online_decode_steps_fill_their_own_window_and_fit_the_term():
    line = StepTimeModel(seconds_per_token=2e-3, intercept_s=0.04, seconds_per_decode_context=2e-5)
    online = StepTimePredictor(StepTimeModel(), window=12, decode_window=12, refit_every=1)
    for tokens in (128, 512, 1024, 2048) * 3:
        online.observe(tokens, line.predict_step(tokens, 0), tokens * tokens)
    prefill_steps = list(online._recent)
    # Hundreds of decode-only steps: without a window of their own they would evict every
    # prefill point and the model would forget what prompts cost.
    for step in range(300):
        batch, context = 1 + step % 8, 64 + 40 * step
        online.observe(batch, line.predict_step(batch, 0, context), 0, context)
    model = online.current
    assert len(online._points) == 12
    assert model.seconds_per_decode_context == pytest.approx(2e-5, rel=1e-6)
    assert model.predict(2048) == pytest.approx(line.predict(2048), rel=1e-6)
    # The margin is about prefills: decode-only steps add no residual (the refits recompute
    # the prefills' residuals against each new model).
    assert list(online._recent) == prefill_steps and len(online._residuals) == 12


def _decode(req_id: str, context: int, tpot_ms: float, now: float) -> Request:
    request = make_request(req_id, context - 1)
    request.tpot_slo_ms = tpot_ms
    request.status = RequestStatus.RUNNING
    request.append_output_token(1)
    request.num_computed_tokens = context - 1  # its latest token is what this step computes
    request.last_token_time = now
    return request


def _tpot_cap(context: int) -> int:
    seed = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.01, seconds_per_decode_context=1e-5)
    policy = SlackPolicy("slo", "suspend", StepTimePredictor(seed))
    ops = FakeScheduler(waiting=UrgencyQueue(policy.urgency))
    ops.running = [_decode(f"d{i}", context, 1000.0, 0.0) for i in range(4)]
    now = time.monotonic()
    for request in ops.running:
        request.last_token_time = now
    assert all(r.num_tokens_owed == 1 and r.num_tokens == context for r in ops.running)
    policy.begin_step(ops)
    return policy.caps.cap_for_tpot(ops, _step(budget=4096))


def test_the_tpot_cap_leaves_room_for_the_kv_the_decodes_read():
    short, long = _tpot_cap(64), _tpot_cap(8000)
    # 4 decodes x (8000 - 64) more KV tokens x 1e-5 s = 0.317 s: at 1 ms a token, 317 tokens
    # of prefill fewer.
    assert 317 - 3 <= short - long <= 317 + 3
    assert long > 0


def test_a_waiter_s_slack_counts_the_decodes_beside_it():
    seed = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.01, seconds_per_decode_context=1e-4)
    policy = SlackPolicy("slo", "suspend", StepTimePredictor(seed))
    ops = FakeScheduler(waiting=UrgencyQueue(policy.urgency))
    before = policy.predict_prefill(200)
    ops.running = [_decode("d", 5000, 1000.0, time.monotonic())]
    policy.begin_step(ops)
    assert policy.predict_prefill(200) == pytest.approx(before + 0.5)


def test_the_engine_feeds_decode_steps_to_the_model_with_their_context(tiny_model):
    engine = EngineCore(build_engine_config(tiny_model("llama"), dtype="float32",
                                            num_kv_blocks=64))
    try:
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        engine.add_request(Request(request_id="a", prompt_token_ids=[5] * 20,
                                   sampling_params=params, arrival_time=time.monotonic()))
        while engine.has_unfinished_requests():
            engine.step()
        online = engine.step_time_predictor
        # One prefill step, then four decodes reading 21 .. 24 KV tokens (after the startup
        # calibration's points, which seed the windows).
        assert [(p.tokens, p.attention, p.share) for p in online._points][-1] == (20, 400, 1)
        assert [(p.tokens, p.attention, p.decode_context) for p in online._decode_points][-4:] \
            == [(1, 0, 21), (1, 0, 22), (1, 0, 23), (1, 0, 24)]
    finally:
        engine.shutdown()
