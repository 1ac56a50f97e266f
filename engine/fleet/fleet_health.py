"""The fleet's /health: ok, degraded (serving, but short of replicas or of their reports), or
unavailable (503, so a load balancer in front stops sending): no replica reports, or the
ingress's router has not started (its error in the report: the router cannot predict, and
`--on-doomed reject` cannot refuse anything, until it has)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from engine.fleet.routing import FleetBook

# serve.status() is a call to the controller: asked at most this often, however often /health
# is probed.
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
        from ray import serve

        for app in serve.status().applications.values():
            deployment = app.deployments.get(self.engine_deployment)
            if deployment is not None:
                return {"status": str(deployment.status.value),
                        "replica_states": {str(getattr(k, "value", k)): v
                                           for k, v in deployment.replica_states.items()},
                        "message": deployment.message}
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
