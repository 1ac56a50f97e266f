"""engine.fleet.autoscaling: the attainment window, the scaling decision and the Ray policy."""

from __future__ import annotations

import ast
import inspect
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engine.fleet.autoscaling as autoscaling
from engine.fleet.autoscaling import (MAX_REPORTED_SLACK_S, AttainmentWindow,
                                      DeadlineAutoscalingPolicy, ScalingOptions,
                                      decide_replicas, deadline_autoscaling_policy,
                                      fleet_attainment)

T0 = 1_000_000.0


def test_window_predicted_outcome_replaced_by_the_real_one():
    w = AttainmentWindow(window_s=30.0)
    w.on_predicted("a", deadline=T0 + 1, predicted_first_token_at=T0 + 2, now=T0)  # miss
    w.on_predicted("b", deadline=T0 + 1, predicted_first_token_at=T0 + 0.5, now=T0)  # met
    s = w.stats(T0)
    assert s["urgent_attainment"] == 0.5 and s["urgent_requests"] == 2
    assert s["urgent_missed"] == 1
    w.on_first_token("a", deadline=T0 + 1, at=T0 + 0.9)  # it made it after all
    w.on_predicted("a", deadline=T0 + 1, predicted_first_token_at=T0 + 5, now=T0 + 1)
    assert w.stats(T0 + 1)["urgent_attainment"] == 1.0  # the real outcome stands
    w.on_predicted("c", deadline=T0 + 1, predicted_first_token_at=T0 + 2, now=T0 + 1)
    w.forget("c")  # aborted: neither met nor missed
    assert w.stats(T0 + 1)["urgent_requests"] == 2


def test_window_slides():
    w = AttainmentWindow(window_s=30.0)
    w.on_predicted("a", deadline=T0, predicted_first_token_at=T0 + 1, now=T0)
    w.on_slack(0.2, T0)
    w.on_slack(0.8, T0 + 20)
    assert w.stats(T0 + 25)["min_slack_s"] == 0.2
    s = w.stats(T0 + 31)
    assert s["min_slack_s"] == 0.8 and s["urgent_requests"] == 0
    assert s["urgent_attainment"] == 1.0
    assert w.stats(T0 + 100)["min_slack_s"] == MAX_REPORTED_SLACK_S
    with pytest.raises(ValueError):
        AttainmentWindow(window_s=0)


def stats(attainment: float, n: float, slack: float) -> dict[str, float]:
    return {"urgent_attainment": attainment, "urgent_requests": n, "min_slack_s": slack}


def test_fleet_attainment_weights_by_urgent_requests():
    att, n = fleet_attainment({"a": stats(0.5, 10, 0), "b": stats(1.0, 30, 0),
                               "c": stats(0.0, 0, 0)})
    assert att == pytest.approx(0.875) and n == 40
    assert fleet_attainment({}) == (1.0, 0.0)


OPTS = ScalingOptions(upscale_delay_s=10, downscale_delay_s=60, downscale_slack_s=1.0,
                      min_replicas=1, max_replicas=4)


def run(current: int, samples, start: float = T0, step: float = 1.0):
    """Feed the same stats every `step` seconds; the targets decided."""
    state: dict = {}
    targets = []
    now = start
    for per_replica in samples:
        current, state = decide_replicas(current, per_replica, OPTS, state, now)
        targets.append(current)
        now += step
    return targets


def test_scale_up_after_the_delay_then_wait_a_whole_delay_again():
    low = {"a": stats(0.8, 20, -0.1), "b": stats(0.9, 20, 0.0)}
    targets = run(2, [low] * 25)
    # Low from t=0: up at t=10, and again only at t=21 (the clock restarts at the change).
    assert targets[9] == 2 and targets[10] == 3 and targets[20] == 3 and targets[21] == 4
    assert max(targets) == 4  # max_replicas


def test_burst_shorter_than_the_delay_does_not_scale():
    low = {"a": stats(0.5, 20, -1.0)}
    ok = {"a": stats(1.0, 20, 0.5)}
    assert run(2, [low] * 5 + [ok] + [low] * 5 + [ok] * 3) == [2] * 14


def test_too_few_urgent_requests_say_nothing():
    assert run(2, [{"a": stats(0.0, 2, -1.0)}] * 30) == [2] * 30


def test_scale_down_when_every_replica_has_slack_for_the_delay():
    roomy = {"a": stats(1.0, 50, 2.0), "b": stats(1.0, 50, 3.0)}
    one_tight = {"a": stats(1.0, 50, 2.0), "b": stats(1.0, 50, 0.5)}
    targets = run(3, [roomy] * 130)
    # Down at t=60; the clock restarts at t=61, so down again at t=121, not before.
    assert targets[59] == 3 and targets[60] == 2 and targets[120] == 2 and targets[121] == 1
    assert targets[-1] == 1  # min_replicas
    assert run(3, [one_tight] * 130) == [3] * 130


def test_no_flapping_between_up_and_down():
    """Alternating evidence never changes the target faster than a whole delay apart."""
    low = {"a": stats(0.5, 20, -1.0)}
    roomy = {"a": stats(1.0, 20, 5.0)}
    samples = ([low] * 12 + [roomy] * 8) * 10
    targets = run(2, samples)
    changes = [i for i in range(1, len(targets)) if targets[i] != targets[i - 1]]
    assert all(b - a >= OPTS.upscale_delay_s for a, b in zip(changes, changes[1:]))
    assert all(targets[i] > targets[i - 1] for i in changes)  # never down: lulls are short


@settings(max_examples=100, deadline=None, database=None)
@given(samples=st.lists(st.dictionaries(
    st.sampled_from("abc"),
    st.builds(stats, st.floats(0, 1), st.floats(0, 100), st.floats(-5, 5))), max_size=80),
    current=st.integers(1, 4))
def test_targets_stay_in_bounds_and_move_by_one(samples, current):
    targets = run(current, samples)
    previous = current
    for t in targets:
        assert OPTS.min_replicas <= t <= OPTS.max_replicas
        assert abs(t - previous) <= 1
        previous = t


def ctx(**kw) -> SimpleNamespace:
    base = dict(current_num_replicas=2, target_num_replicas=2, policy_state={},
                current_time=T0, capacity_adjusted_min_replicas=1,
                capacity_adjusted_max_replicas=5, aggregated_metrics={})
    base.update(kw)
    return SimpleNamespace(**base)


def test_ray_policy_function_with_a_fake_context():
    metrics = {"urgent_attainment": {"r1": 0.5, "r2": 0.7},
               "urgent_requests": {"r1": 10.0, "r2": 10.0},
               "min_slack_s": {"r1": -0.2, "r2": 0.1}}
    target, state = deadline_autoscaling_policy(ctx(aggregated_metrics=metrics))
    assert target == 2 and state["low_since"] == T0 and state["attainment"] == pytest.approx(0.6)
    target, state = deadline_autoscaling_policy(
        ctx(aggregated_metrics=metrics, policy_state=state, current_time=T0 + 10))
    assert target == 3
    # Ray's capacity-adjusted max bounds it.
    at_max = {"low_since": T0}
    assert deadline_autoscaling_policy(ctx(aggregated_metrics=metrics, policy_state=at_max,
                                           current_time=T0 + 10, target_num_replicas=5))[0] == 5
    # Below Ray's minimum: raised to it at once.
    assert deadline_autoscaling_policy(ctx(target_num_replicas=0,
                                           capacity_adjusted_min_replicas=1))[0] == 1


def test_ray_policy_class_takes_policy_kwargs():
    policy = DeadlineAutoscalingPolicy(upscale_delay_s=0.0, target_attainment=0.99)
    metrics = {"urgent_attainment": {"r1": 0.98}, "urgent_requests": {"r1": 100.0},
               "min_slack_s": {"r1": 0.0}}
    assert policy(ctx(aggregated_metrics=metrics))[0] == 3
    with pytest.raises(ValueError):
        DeadlineAutoscalingPolicy(upscale_delay=1)


def test_module_does_not_import_ray():
    tree = ast.parse(inspect.getsource(autoscaling))
    names = [alias.name for node in ast.walk(tree)
             if isinstance(node, (ast.Import, ast.ImportFrom))
             for alias in node.names] + [node.module or "" for node in ast.walk(tree)
                                         if isinstance(node, ast.ImportFrom)]
    assert not any(name.split(".")[0] == "ray" for name in names)
