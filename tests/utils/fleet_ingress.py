"""The fleet's ingress without Ray's actors (test helper): a fake engine handle stands for the
replicas, scripted stream by stream, so that the ingress's paths run deterministically in the
test's own event loop. Needs Ray Serve installed (its exception types), not running."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from ray.exceptions import RayActorError

from engine.config import build_engine_config
from engine.fleet.asgi_bridge import ResponseStart
from engine.fleet.ingress import FleetIngress, IngressSettings
from engine.ports import free_port

DEPLOYMENT = "TestEngine"


class FakeStream:
    """What `handle.remote(...)` returns for a streaming call: parts, or an error at a point
    (`fail_at` parts in; `error`, by default a dead replica's)."""

    def __init__(self, parts: list, fail_at: int | None = None,
                 error: BaseException | None = None) -> None:
        self.parts, self.fail_at, self.cancelled = parts, fail_at, False
        self.error = error

    def __aiter__(self) -> AsyncIterator:
        return self

    async def __anext__(self):
        if self.fail_at == 0:
            raise self.error if self.error is not None else RayActorError()
        if not self.parts:
            raise StopAsyncIteration
        if self.fail_at is not None:
            self.fail_at -= 1
        return self.parts.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """The engine deployment's handle: each call takes the next scripted stream. The ingress's
    warm-up probe (a replica's /health) fails with each of `probe_errors` in turn, then
    answers."""

    def __init__(self, streams: list[FakeStream],
                 probe_errors: list[BaseException] | None = None) -> None:
        self.streams, self.calls, self.handle_options = streams, [], {}
        self.probe_errors = list(probe_errors or [])
        self.probes = 0

    def options(self, **options) -> FakeHandle:
        self.handle_options.update(options)
        return self

    @property
    def handle(self) -> FakeHandle:
        return self

    def remote(self, forwarded, hint=None) -> FakeStream:
        if forwarded.path == "/health":  # the ingress's warm-up probe
            self.probes += 1
            if self.probe_errors:
                return FakeStream([], fail_at=0, error=self.probe_errors.pop(0))
            return FakeStream([ResponseStart(status=200), b"{}"])
        self.calls.append((forwarded, hint))
        return self.streams.pop(0)


async def start_ingress(model: str, streams: list[FakeStream],
                        probe_errors: list[BaseException] | None = None,
                        **settings) -> FleetIngress:
    """An ingress on a FakeHandle, built in the running event loop (its warm-up task and its
    HTTP server, on a free port, too)."""
    ingress = FleetIngress.__new__(FleetIngress)
    config = build_engine_config(model, device="cpu", dtype="float32")
    settings.setdefault("port", free_port())
    await ingress.__init__(FakeHandle(streams, probe_errors), config,
                           IngressSettings(engine_deployment=DEPLOYMENT, **settings))
    return ingress


async def call(ingress: FleetIngress, method: str, path: str, body: dict | None = None,
               headers: dict | None = None) -> httpx.Response:
    """One HTTP request through the ingress's ASGI entry (what its HTTP server runs)."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=ingress._serve_http),
                                 base_url="http://fleet") as client:
        return await client.request(method, path, json=body, headers=headers or {})
