"""The fleet's /health: ok, degraded (serving, but short of replicas or of their reports), or
unavailable (503, so a load balancer in front stops sending): no replica reports, or the
ingress's router has not started (its error in the report: the router cannot predict, and
`--on-doomed reject` cannot refuse anything, until it has)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from engine.fleet.routing import FleetBook

# The deployment's status is a call to Serve's controller: asked at most this often, however
# often /health is probed.
STATUS_CACHE_S = 1.0


@dataclass
class RouterStart:
    """How the ingress's first routed request (the probe that creates its router) is getting
    on: the ingress updates it, /health reads it."""

    started: bool = False
    attempts: int = 0
    # The last failure, as `Type: message` (its traceback is in the ingress's log).
    error: str | None = None

    def report(self) -> dict[str, Any]:
        return {"started": self.started, "attempts": self.attempts, "error": self.error}


def serve_details() -> dict[str, Any]:
    """What `serve.status()` is built from, as the controller sends it: a dict of applications,
    their deployments, each deployment's status, message and replicas (each with its state).
    serve.status() validates that dict into Ray's pydantic schema first, and the schema's
    RequestRouterConfig cloudpickles the router class on every call: 15-30 ms of CPU in the
    caller on an idle 2-core host, 26-48 ms in the ingress during a flood, holding the GIL of
    the process that relays every stream; read as it comes, 0.6-1.0 ms (bench/RESULTS.md,
    Overload; `python -m bench.diagnostics.fleet_status_cost`)."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    return {} if client is None else client.get_serve_details()


def _value(state: Any) -> str:
    """A status or replica state as its name (the dict holds Ray's enums)."""
    return str(getattr(state, "value", state))


class FleetHealth:
    def __init__(self, engine_deployment: str, book: Callable[[], FleetBook | None],
                 router: RouterStart | None = None) -> None:
        """`router`: the ingress's router start (None: taken as started)."""
        self.engine_deployment = engine_deployment
        self._book = book
        self._router = router
        self._status: dict[str, Any] | None = None
        self._status_at = 0.0

    def _deployment_status(self) -> dict[str, Any]:
        for app in serve_details().get("applications", {}).values():
            deployment = app.get("deployments", {}).get(self.engine_deployment)
            if deployment is not None:
                states = Counter(_value(r["state"]) for r in deployment.get("replicas", []))
                return {"status": _value(deployment["status"]), "replica_states": dict(states),
                        "message": deployment.get("message", "")}
        return {"status": "UNKNOWN", "replica_states": {}, "message": "deployment not found"}

    async def report(self) -> dict[str, Any]:
        now = time.monotonic()
        if self._status is None or now - self._status_at > STATUS_CACHE_S:
            self._status = await asyncio.to_thread(self._deployment_status)
            self._status_at = now
        deployment = self._status
        book = self._book()
        fresh, stale = (book.fresh_and_stale(time.time()) if book is not None else ([], []))
        states = deployment["replica_states"]
        running = states.get("RUNNING", 0)
        not_running = sum(n for state, n in states.items() if state != "RUNNING")
        router = self._router
        if (router is not None and not router.started) or (book is not None and not fresh):
            status = "unavailable"
        elif (deployment["status"] != "HEALTHY" or not_running or stale
              or (book is not None and len(fresh) < running)):
            # Short of replicas (one died, is starting or stopping), or one that Ray Serve
            # counts as running does not report (dead before Ray Serve noticed, or hung).
            status = "degraded"
        else:
            status = "ok"
        report = {"status": status, "deployment": deployment,
                  "replicas": {"running": running, "reporting": len(fresh),
                               "not_reporting": sorted(stale)}}
        if router is not None:
            report["router"] = router.report()
        return report

    async def response(self) -> Response:
        report = await self.report()
        code = 503 if report["status"] == "unavailable" else 200
        return Response(json.dumps(report), code, media_type="application/json")
