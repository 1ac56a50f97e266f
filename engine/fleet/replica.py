"""One replica of a fleet: a whole sloserve engine inside a Ray Serve deployment.

The replica runs the single-engine server's own FastAPI app (engine.serving.api_server) in its
actor, without a socket: the ingress forwards each HTTP request it read and the replica streams
the app's response back (engine.fleet.asgi_bridge). So a fleet answers exactly as one server
does: the same routes, validation, errors, streaming formats, SLO headers and edge stamps.

Ray Serve calls `record_routing_stats` every report period (the router's view of this replica's
queue: engine.fleet.load_report) and `record_autoscaling_stats` for the deadline autoscaling
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

from engine.config import EngineConfig
from engine.fleet.asgi_bridge import ForwardedRequest, ResponseStart, call_app
from engine.fleet.autoscaling import AttainmentWindow
from engine.fleet.load_report import ReplicaLoad, RouteHint, encode_load
from engine.serving.api_server import ServerSettings, build_app

logger = logging.getLogger(__name__)


class EngineReplica:
    """The deployment's class (engine.fleet.launch wraps it in `serve.deployment`)."""

    async def __init__(self, config: EngineConfig, settings: ServerSettings,
                 attainment_window_s: float = 30.0) -> None:
        self.app = build_app(config, settings)
        self.client = self.app.state.client
        # The app's lifespan starts the EngineCore process (and stops it in __del__).
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        self._attainment = AttainmentWindow(window_s=attainment_window_s)
        self._last_load: ReplicaLoad | None = None
        logger.info("fleet replica ready (pid %d)", os.getpid())

    async def handle(self, request: ForwardedRequest, hint: RouteHint | None = None
                     ) -> AsyncIterator[ResponseStart | bytes]:
        """One HTTP request through the engine's app; `hint` is read by the router, not here."""
        async for part in call_app(self.app, request):
            yield part

    async def record_routing_stats(self) -> dict[str, bytes]:
        load = await self.client.load_report()
        self._last_load = load
        self._attainment.observe_load(load, time.time())
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
