"""One replica of a fleet: a whole sloserve engine inside a Ray Serve deployment.

The replica runs the single-engine server's own FastAPI app (engine.serving.api_server) in its
actor, without a socket: the ingress forwards each HTTP request it read and the replica streams
the app's response back (engine.fleet.asgi_bridge). So a fleet answers exactly as one server
does: the same routes, validation, errors, streaming formats, SLO headers and edge stamps.

Ray Serve calls `record_routing_stats` every report period (the router's view of this replica's
queue: engine.load.load_report) and `record_autoscaling_stats` for the deadline autoscaling
policy; `check_health` fails when the engine died, so Ray Serve replaces the replica. When Ray
Serve removes the replica (scale-down, a rolling update) it stops routing to it and waits for its
ongoing requests (the deployment's graceful_shutdown_timeout_s: `--shutdown-mode wait`) before
`__del__` stops the engine.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator

import msgspec

from engine.config import EngineConfig
from engine.fleet.asgi_bridge import ForwardedRequest, ResponseStart, call_app
from engine.fleet.autoscaling import MAX_REPORTED_SLACK_S, AttainmentWindow
from engine.fleet.fleet_metrics import carries_output
from engine.load.load_report import ReplicaLoad, RouteHint, encode_load
from engine.load.prediction import predict, prefill_seconds
from engine.ipc.core_launch import CoreLaunch
from engine.serving.api_server import ServerSettings, build_app

logger = logging.getLogger(__name__)

# Names the replica that served a response (logs, tests, debugging a routing decision).
REPLICA_HEADER = b"x-sloserve-replica"
# The router's predicted TTFT (ms from arrival) on that replica when it sent the request there,
# set by the ingress: a benchmark tells a routing decision's miss from a miss it foresaw.
PREDICTED_TTFT_HEADER = b"x-sloserve-predicted-ttft-ms"


def _replica_id() -> str:
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (a test constructing the class directly)
        return f"pid-{os.getpid()}"


class EngineReplica:
    """The deployment's class (engine.fleet.launch wraps it in `serve.deployment`)."""

    async def __init__(self, config: EngineConfig, settings: ServerSettings,
                 attainment_window_s: float = 30.0) -> None:
        # EngineCore's process imports while the app loads its tokenizer; the app's lifespan
        # adopts it, sends it what to build (and stops it in __del__), and a failure before
        # then ends it (engine.ipc.core_launch).
        with CoreLaunch.start(config.model.model) as launch:
            self.app = build_app(config, settings, launch)
            self.client = self.app.state.client
            self._lifespan = self.app.router.lifespan_context(self.app)
            await self._lifespan.__aenter__()
        self._queue_bound = settings.queue_bounds.max_requests
        self._attainment = AttainmentWindow(window_s=attainment_window_s)
        self.replica_id = _replica_id()
        self._last_load: ReplicaLoad | None = None
        logger.info("fleet replica ready (pid %d)", os.getpid())

    async def handle(self, request: ForwardedRequest, hint: RouteHint | None = None
                     ) -> AsyncIterator[ResponseStart | bytes]:
        """One HTTP request through the engine's app. `hint` (the router's view of it) feeds
        the attainment window: its predicted outcome now, its real one at its first output."""
        deadline = None if hint is None else hint.deadline()
        if deadline is not None and self._last_load is not None:
            prediction = predict(self._last_load, (), hint, time.time())
            self._attainment.on_predicted(hint.request_id, deadline,
                                          hint.arrived_at + prediction.ttft_s, time.time())
        awaiting_first = deadline is not None
        try:
            async for part in call_app(self.app, request):
                if isinstance(part, ResponseStart):
                    part = ResponseStart(status=part.status, headers=[
                        *part.headers, (REPLICA_HEADER, self.replica_id.encode())])
                elif awaiting_first and carries_output(part):
                    awaiting_first = False
                    self._attainment.on_first_token(hint.request_id, deadline, time.time())
                yield part
        finally:
            if awaiting_first:  # ended (an error, the client gone) before any output
                self._attainment.forget(hint.request_id)

    async def record_routing_stats(self) -> dict[str, bytes]:
        load = await self.client.load_report()
        if self._queue_bound is not None:  # the server's bound, not the engine's: told here
            load = msgspec.structs.replace(load, max_queued_requests=self._queue_bound)
        self._last_load = load
        self._attainment.on_slack(min_slack_s(load), load.made_at)
        return {"load": encode_load(load)}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return self._attainment.stats(time.time())

    async def check_health(self) -> None:
        if not self.client.is_alive():
            raise RuntimeError(f"the engine is not running: {self.client.dead or 'exited'}")

    def pid(self) -> int:
        """The actor's process id (the fault tests kill it)."""
        return os.getpid()

    async def __del__(self) -> None:
        # Ray Serve has drained the replica's requests by now (or given up after its timeout).
        await self._lifespan.__aexit__(None, None, None)


def min_slack_s(load: ReplicaLoad) -> float:
    """The least slack (time to deadline less predicted remaining prefill) among the replica's
    queued requests with a TTFT objective; MAX_REPORTED_SLACK_S with none: nothing urgent."""
    slacks = [q.time_to_deadline_s - prefill_seconds(load, q.remaining_prefill_tokens)
              for q in (*load.waiting, *load.running) if q.time_to_deadline_s is not None]
    return min(slacks, default=MAX_REPORTED_SLACK_S)
