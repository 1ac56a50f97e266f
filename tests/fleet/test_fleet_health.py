"""The fleet's /health reads its engine deployment from Serve's controller as the controller
sends it (engine.fleet.fleet_health.serve_details: a dict holding Ray's enums), not through
serve.status(). No cluster starts here; tests/fleet/test_fleet_serving.py checks the same
reading against serve.status() on a live fleet."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve", reason="the fleet's tests need Ray Serve: pip install -e "
                                        "'.[test,cluster]'")

from ray.serve._private.common import DeploymentStatus, ReplicaState

import engine.fleet.fleet_health as fleet_health
from engine.fleet.fleet_health import FleetHealth


def _details(*states: ReplicaState) -> dict:
    return {"applications": {"sloserve": {"deployments": {
        "SloserveIngress": {"status": DeploymentStatus.HEALTHY, "message": "",
                            "replicas": [{"state": ReplicaState.RUNNING}]},
        "SloserveEngine": {"status": DeploymentStatus.UPDATING,
                           "message": "Scaling up from 2 to 3 replicas.",
                           "replicas": [{"state": s} for s in states]}}}}}


def test_the_engine_deployment_is_read_with_its_replicas_counted_by_state(monkeypatch):
    monkeypatch.setattr(fleet_health, "serve_details", lambda: _details(
        ReplicaState.RUNNING, ReplicaState.STARTING, ReplicaState.RUNNING))
    health = FleetHealth("SloserveEngine", lambda: None)
    assert health._deployment_status() == {
        "status": "UPDATING", "replica_states": {"RUNNING": 2, "STARTING": 1},
        "message": "Scaling up from 2 to 3 replicas."}


def test_a_missing_deployment_or_controller_reads_as_unknown(monkeypatch):
    monkeypatch.setattr(fleet_health, "serve_details", lambda: _details(ReplicaState.RUNNING))
    assert FleetHealth("Other", lambda: None)._deployment_status()["status"] == "UNKNOWN"
    monkeypatch.setattr(fleet_health, "serve_details", lambda: {})  # no controller running
    assert FleetHealth("SloserveEngine", lambda: None)._deployment_status() == {
        "status": "UNKNOWN", "replica_states": {}, "message": "deployment not found"}
