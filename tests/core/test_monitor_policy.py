"""Slack-EDF policy and TTFT predictor (docs/design.md section 5)."""

import math
import random

import pytest

from monitor.policy import RequestView, choose_slo_preemption, should_slo_preempt, urgency
from monitor.predictor import StepTimePredictor
from monitor.step_time_fit import fit_line, fit_quadratic
from monitor.step_time_model import StepTimeModel

NOW = 1000.0
# 1 ms per token, no intercept: remaining TTFT in seconds = tokens / 1000.
PREDICT = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.0).predict


def view(rid, deadline_in, tokens, preempted=False):
    deadline = None if deadline_in is None else NOW + deadline_in
    return RequestView(rid, deadline, tokens, slo_preempted=preempted)


def test_slack_and_priority():
    u = urgency(view("a", 0.5, 100), NOW, PREDICT)
    assert u.time_to_deadline == pytest.approx(0.5)
    assert u.slack == pytest.approx(0.4)
    assert u.priority == pytest.approx(2.0)
    doomed = urgency(view("b", 0.5, 900), NOW, PREDICT)
    assert doomed.doomed and doomed.priority == pytest.approx(-2.0)
    assert urgency(view("c", None, 100), NOW, PREDICT).priority == 0.0


def test_priority_order_puts_doomed_last():
    views = [view("relaxed", 10.0, 100), view("doomed-soon", 0.1, 500),
             view("urgent", 0.3, 100), view("no-slo", None, 100), view("doomed-late", 2.0, 5000)]
    order = sorted(views, key=lambda v: urgency(v, NOW, PREDICT).priority, reverse=True)
    assert [v.request_id for v in order] == ["urgent", "relaxed", "no-slo", "doomed-late",
                                            "doomed-soon"]


@pytest.mark.parametrize("w_slack,r_slack,expected", [
    (+1, +1, None),   # both positive: decided by priorities and the margin (tested below)
    (-1, +1, False),  # waiter doomed: never
    (+1, -1, True),   # running doomed: always gives up its slot
    (-1, -1, False),  # both doomed: never
])
def test_four_sign_cases(w_slack, r_slack, expected):
    # Waiter more urgent than the runner in every case, so only the signs decide.
    waiter = view("w", 0.2, 100 if w_slack > 0 else 400)
    runner = view("r", 0.8, 100 if r_slack > 0 else 1000)
    decision = choose_slo_preemption([waiter], [runner], NOW, PREDICT, margin=1.2)
    if expected is None:
        assert decision is not None  # priority 5 vs 1.25: beats it by far more than the margin
    else:
        assert (decision is not None) == expected


def test_margin_on_positive_priorities():
    runner = view("r", 1.0, 100)  # priority 1.0
    just_better = view("w", 0.9, 100)  # priority 1.11 < 1.2 * 1.0
    clearly_better = view("w2", 0.8, 100)  # priority 1.25 > 1.2
    assert choose_slo_preemption([just_better], [runner], NOW, PREDICT, margin=1.2) is None
    assert choose_slo_preemption([just_better], [runner], NOW, PREDICT, margin=1.0) is not None
    assert choose_slo_preemption([clearly_better], [runner], NOW, PREDICT, margin=1.2) is not None


def test_margin_is_not_applied_to_negative_priorities():
    # Running doomed with priority -10 and a positive waiter: 1.2 * -10 = -12 would also pass,
    # but the point is that a doomed waiter never passes even against a "smaller" negative.
    w, r = urgency(view("w", 0.1, 500), NOW, PREDICT), urgency(view("r", 0.05, 500), NOW, PREDICT)
    assert w.doomed and r.doomed and w.priority > 1.2 * r.priority
    assert not should_slo_preempt(w, r, margin=1.2)


def test_conservative_vs_aggressive_on_heterogeneous_running_set():
    running = [view("hot", 0.25, 50), view("cold", 5.0, 100)]  # priorities 4 and 0.2
    waiter = view("w", 0.5, 50)  # priority 2: beats cold, not hot
    assert choose_slo_preemption([waiter], running, NOW, PREDICT, "conservative") is None
    decision = choose_slo_preemption([waiter], running, NOW, PREDICT, "aggressive")
    assert decision is not None and decision.victim_id == "cold" and decision.waiter_id == "w"


def test_rule_one_excludes_slo_preempted_runners():
    running = [view("victim-before", 5.0, 100, preempted=True)]
    waiter = view("w", 0.3, 50)
    assert choose_slo_preemption([waiter], running, NOW, PREDICT, "aggressive") is None
    running.append(view("fresh", 5.0, 100))
    decision = choose_slo_preemption([waiter], running, NOW, PREDICT, "aggressive")
    assert decision is not None and decision.victim_id == "fresh"


def test_best_waiter_is_chosen_and_waiters_without_slo_never_preempt():
    running = [view("r", 5.0, 100)]
    assert choose_slo_preemption([view("best-effort", None, 10)], running, NOW, PREDICT) is None
    waiters = [view("w-later", 2.0, 10), view("w-urgent", 0.3, 10)]
    assert choose_slo_preemption(waiters, running, NOW, PREDICT).waiter_id == "w-urgent"


def test_bad_policy_arguments():
    with pytest.raises(ValueError, match="policy"):
        choose_slo_preemption([], [], NOW, PREDICT, "reckless")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="margin"):
        choose_slo_preemption([], [], NOW, PREDICT, margin=0.5)


def test_fit_recovers_a_noisy_line_and_reports_r2():
    rng = random.Random(0)
    points = [(n, 2e-4 * n + 0.03 + rng.gauss(0, 1e-3)) for n in range(64, 4096, 64)]
    line = fit_line(points)
    assert line.seconds_per_token == pytest.approx(2e-4, rel=0.02)
    assert line.intercept_s == pytest.approx(0.03, abs=3e-3)
    assert 0.99 < line.r2 <= 1.0
    assert line.predict(0) == 0.0 and line.predict(1000) == pytest.approx(0.23, rel=0.02)


def test_fit_needs_two_token_counts():
    with pytest.raises(ValueError, match="two or more token counts"):
        fit_line([(100, 0.1), (100, 0.11)])


def test_save_load_roundtrip_and_bad_file(tmp_path):
    line = StepTimeModel(seconds_per_token=3e-4, intercept_s=0.02, r2=0.98)
    line.save(tmp_path / "ttft.json")
    assert StepTimeModel.load(tmp_path / "ttft.json") == line
    (tmp_path / "bad.json").write_text('{"slope": 1}')
    with pytest.raises(ValueError, match="calibrat"):
        StepTimeModel.load(tmp_path / "bad.json")


def test_online_refit_replaces_the_seed():
    online = StepTimePredictor(refit_every=4)
    seed = online.current
    for n in (100, 200, 400, 800):
        online.observe(n, 5e-4 * n + 0.01)
    assert online.current is not seed
    assert online.current.seconds_per_token == pytest.approx(5e-4)
    assert online.predict(1000) == pytest.approx(0.51)
    assert not math.isnan(online.current.r2)


def test_quadratic_fit_recovers_the_attention_term_and_inverts():
    rng = random.Random(1)
    truth = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.02, seconds_per_token_sq=2e-7)
    points = [(n, n * n, truth.predict(n) * (1 + rng.gauss(0, 0.01)))
              for n in range(64, 4096, 128)]
    fitted = fit_quadratic(points)
    assert fitted.seconds_per_token_sq == pytest.approx(2e-7, rel=0.1)
    assert fitted.predict(3000) == pytest.approx(truth.predict(3000), rel=0.02)
    # Inverse of predict: the most tokens within a time.
    n = fitted.max_tokens_within(fitted.predict(1500))
    assert n in (1499, 1500)
    assert fitted.max_tokens_within(fitted.intercept_s / 2) == 0
    # A step of two 1000-token prompts costs less attention than one 2000-token prompt.
    assert truth.predict_step(2000, 2 * 1000 ** 2) < truth.predict(2000)


def test_quadratic_fit_without_curvature_is_the_line():
    points = [(n, n * n, 5e-4 * n + 0.01) for n in (100, 200, 400, 800)]
    fitted = fit_quadratic(points)
    assert fitted.seconds_per_token_sq == 0.0
    assert fitted.seconds_per_token == pytest.approx(5e-4)


def test_online_refit_keeps_the_attention_term_of_a_quadratic_seed(tmp_path):
    seed = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.02, seconds_per_token_sq=1e-7)
    seed.save(tmp_path / "q.json")
    assert StepTimeModel.load(tmp_path / "q.json") == seed
    online = StepTimePredictor(StepTimeModel.load(tmp_path / "q.json"), refit_every=6)
    truth = StepTimeModel(seconds_per_token=2e-3, intercept_s=0.01, seconds_per_token_sq=3e-7)
    # Mixed steps: (tokens, attention work) of several chunks each.
    steps = [(300, 90_000), (1200, 700_000), (2500, 3_000_000), (800, 640_000),
             (4000, 9_000_000), (1600, 1_300_000)]
    for tokens, attention in steps:
        online.observe(tokens, truth.predict_step(tokens, attention), attention)
    assert online.current.seconds_per_token_sq == pytest.approx(3e-7, rel=1e-3)
    assert online.predict(2000) == pytest.approx(truth.predict(2000), rel=1e-3)


def test_a_waiter_whose_slack_covers_the_rest_of_the_step_does_not_preempt():
    """Necessity: preempting only pays when the waiter would miss by waiting for the step."""
    now = 100.0
    waiter = RequestView("w", deadline=now + 1.0, remaining_prefill_tokens=100)  # slack 0.9 s
    running = [RequestView("r", deadline=now + 60.0, remaining_prefill_tokens=1000)]
    predict = lambda n: n * 1e-3  # noqa: E731
    assert choose_slo_preemption([waiter], running, now, predict, step_remaining_s=0.5) is None
    decision = choose_slo_preemption([waiter], running, now, predict, step_remaining_s=1.5)
    assert decision is not None and decision.victim_id == "r"
    # Without the step's remaining time the gate is the priority comparison alone.
    assert choose_slo_preemption([waiter], running, now, predict) is not None


def test_the_steps_own_pace_reveals_that_it_runs_longer_than_predicted():
    """Predicted 1 s over 30 layers; the rank reports 20 layers done 2 s into the step, so the
    step runs 3x slower than predicted and 1 s is left, more than the waiter's 0.5 s of slack:
    the monitor fires. Paired probes: 20 layers done on time (0.67 s in) leaves 0.33 s, which
    the slack covers, so it waits; another step's progress is ignored."""
    import time

    from monitor.monitor import MonitorSnapshot, SLOMonitor
    from monitor.slo_preempt_signal import SLOPreemptSignal

    signal = SLOPreemptSignal.create()
    try:
        monitor = SLOMonitor(signal)  # not started: check() is called directly
        now = time.monotonic()
        started = now - 2.0
        waiter = RequestView("w", deadline=now + 0.6, remaining_prefill_tokens=100)
        running = RequestView("r", deadline=now + 60.0, remaining_prefill_tokens=3000)
        line = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.0)
        snapshot = MonitorSnapshot(step_id=7, preemptible=True, waiting=(waiter,),
                                   running=(running,), predictor=line, started_at=started,
                                   predicted_step_s=1.0, num_layers=30)
        monitor.publish(snapshot)
        signal.report_progress(7, 20, at=started + 2 / 3)
        assert signal.progress(7) == (20, started + 2 / 3)
        assert monitor.check() is None
        signal.report_progress(6, 29, at=now)  # another step's progress is ignored
        assert signal.layers_done(7) == 0
        signal.report_progress(7, 20, at=now)
        decision = monitor.check()
        assert decision is not None and decision.decision.waiter_id == "w"
        assert signal.target_step_id == 7
    finally:
        signal.close()


def test_before_any_layer_is_done_the_whole_step_is_left():
    """The predictor says the step is over (predicted 1 s, 2 s elapsed) but no layer has
    reported: the step is late, not over, so its whole predicted time is left and a waiter
    with 0.5 s of slack gets a decision (the old estimate, predicted minus elapsed, said 0 s
    and let it wait)."""
    import time

    from monitor.monitor import MonitorSnapshot, SLOMonitor
    from monitor.slo_preempt_signal import SLOPreemptSignal

    signal = SLOPreemptSignal.create()
    try:
        monitor = SLOMonitor(signal)
        now = time.monotonic()
        waiter = RequestView("w", deadline=now + 0.6, remaining_prefill_tokens=100)
        running = RequestView("r", deadline=now + 60.0, remaining_prefill_tokens=3000)
        line = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.0)
        monitor.publish(MonitorSnapshot(step_id=7, preemptible=True, waiting=(waiter,),
                                        running=(running,), predictor=line,
                                        started_at=now - 2.0, predicted_step_s=1.0,
                                        num_layers=30))
        assert monitor.check() is not None
    finally:
        signal.close()


def test_requests_without_a_live_deadline_rank_last_in_their_order_as_views_would() -> None:
    """rank_requests skips the views of requests without a live deadline: the order must be
    what ranking every request through its view gives (random deadlines, some past, some
    aged, some requests without one, some whose first output is out)."""
    import time

    from engine.core.request import Request
    from engine.sampling_params import SamplingParams
    from monitor.policy import rank, rank_requests, view_of

    rng = random.Random(7)
    now = time.monotonic()
    requests = []
    for i in range(60):
        slo = rng.choice([None, 50.0, 150.0, 2000.0])
        request = Request(request_id=f"r{i}", prompt_token_ids=[1] * rng.randint(2, 4000),
                          sampling_params=SamplingParams(max_tokens=4), ttft_slo_ms=slo,
                          arrival_time=now - rng.uniform(0, 3))
        if rng.random() < 0.3:
            request.first_output_time = now  # its client has output: no live deadline
        requests.append(request)
    assert any(r.live_deadline is None for r in requests)  # probe: both kinds present
    assert any(r.live_deadline is not None for r in requests)
    def predict(tokens: int) -> float:
        return 1e-4 * tokens

    assert rank_requests(requests, now, predict, aging_bound_s=1.0) == \
        rank(requests, now, predict, aging_bound_s=1.0, view=view_of)
