"""Admission and autoscaling on a real Ray Serve fleet of tiny, slowed replicas: `reject` answers
429 before any work for a request no replica can serve in time (and the replayed request does
miss), and the deadline policy adds a replica when urgent requests miss."""

from __future__ import annotations

import time

import httpx
import pytest

# Ray Serve comes with the cluster extra, which the README's test command installs.
pytest.importorskip("ray.serve", reason="the fleet's tests need Ray Serve: pip install -e "
                                        "'.[test,cluster]'")

from engine.fleet.autoscaling import ScalingOptions
from engine.fleet.options import APP_NAME, ENGINE_DEPLOYMENT, FleetOptions
from tests.utils.ray_fleet import fleet, replica_env, stream, tiny_fleet_config, wait_for

# Alone (the README's serial run): the session's one Ray instance, and replicas timed against
# each other on the machine's cores.
pytestmark = pytest.mark.serial

DELAY_US_PER_TOKEN = 250  # 4 layers: ~1 ms per prompt token
LONG_PROMPT = [3 + (i * 7919) % 247 for i in range(1200)]
TIGHT_SLO_MS = 60


@pytest.fixture(scope="module")
def fleet_model(tiny_model) -> str:
    return tiny_model("llama", num_hidden_layers=4, max_position_embeddings=2048)


def _steps(url: str) -> int:
    """The replica's engine steps so far (a one-replica fleet forwards /debug/stats to it)."""
    return httpx.get(f"{url}/debug/stats", timeout=30).json()["num_steps"]


def test_reject_answers_429_before_any_work_and_only_for_a_request_that_would_miss(
        fleet_model, ray_serve_port):
    options = FleetOptions(replicas=1, on_doomed="reject",
                           replica_env=replica_env(DELAY_US_PER_TOKEN))
    with fleet(ray_serve_port, tiny_fleet_config(fleet_model, max_model_len=2048), options) as url:
        doomed = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 2,
                  "ttft_slo_ms": TIGHT_SLO_MS}
        steps_before = _steps(url)
        refused = httpx.post(f"{url}/v1/completions", json=doomed, timeout=60)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert "TTFT objective of 60 ms" in error["message"]
        assert error["predicted_ttft_ms"] > TIGHT_SLO_MS
        assert int(refused.headers["retry-after"]) >= 1
        # Before any work: the replica ran no step for it.
        assert _steps(url) == steps_before
        page = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'sloserve:fleet_rejected_total{reason="doomed"} 1.0' in page
        # Replayed under `serve` (no objective to refuse it by), it does miss: the 429 was
        # honest.
        replay = stream(url, {k: v for k, v in doomed.items() if k != "ttft_slo_ms"})
        assert replay.status == 200 and replay.done
        assert replay.first_output_at * 1e3 > TIGHT_SLO_MS, replay.first_output_at
        # A request the fleet can serve in time is served, objective and all.
        feasible = stream(url, {**doomed, "prompt": LONG_PROMPT[:32], "ttft_slo_ms": 5000})
        assert feasible.status == 200 and feasible.done
        # Nothing without an objective is ever refused.
        free = httpx.post(f"{url}/v1/completions", json={**doomed, "ttft_slo_ms": None},
                          timeout=60)
        assert free.status_code == 200, free.text


def _running_replicas() -> int:
    from ray import serve

    app = serve.status().applications.get(APP_NAME)
    if app is None or ENGINE_DEPLOYMENT not in app.deployments:
        return 0
    states = app.deployments[ENGINE_DEPLOYMENT].replica_states
    return sum(n for state, n in states.items() if str(getattr(state, "value", state)) ==
               "RUNNING")


def test_the_deadline_policy_adds_a_replica_when_urgent_requests_miss(fleet_model,
                                                                        ray_serve_port):
    scaling = ScalingOptions(min_replicas=1, max_replicas=2, target_attainment=0.95,
                             upscale_delay_s=0.0, downscale_delay_s=600.0,
                             min_urgent_requests=2)
    options = FleetOptions(replicas=1, autoscaling=scaling, attainment_window_s=20.0,
                           replica_env=replica_env(DELAY_US_PER_TOKEN))
    with fleet(ray_serve_port, tiny_fleet_config(fleet_model, max_model_len=2048), options) as url:
        assert _running_replicas() == 1
        # Light traffic that meets its objectives does not scale.
        for seed in range(3):
            ok = stream(url, {"model": "tiny", "prompt": LONG_PROMPT[seed:seed + 16],
                              "max_tokens": 2, "ttft_slo_ms": 5000})
            assert ok.status == 200 and ok.first_output_at < 5.0
        time.sleep(2.0)
        assert _running_replicas() == 1
        # Urgent requests that miss (served anyway: on_doomed is serve) drop the predicted
        # attainment below the target.
        missed = [stream(url, {"model": "tiny", "prompt": LONG_PROMPT[i:], "max_tokens": 2,
                               "ttft_slo_ms": TIGHT_SLO_MS}) for i in range(3)]
        assert all(r.status == 200 and r.first_output_at * 1e3 > TIGHT_SLO_MS for r in missed)
        wait_for(lambda: _running_replicas() == 2, timeout=120, interval=1.0,
                 what="the policy to add a replica")
