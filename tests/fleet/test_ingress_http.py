"""The fleet ingress's own HTTP server (engine.fleet.ingress_http): it serves an ASGI app on its
port, says why it stopped when it stops by itself, lets an open stream finish when told to stop,
and the ingress answers its own failure on a request with an OpenAI-shaped 500."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.responses import StreamingResponse

from engine.fleet.ingress import FleetIngress
from engine.fleet.ingress_http import IngressHttpServer
from engine.ports import free_port


async def _chunks(release: asyncio.Event):
    yield b"first\n"
    await release.wait()
    yield b"last\n"


def test_a_stream_open_when_the_server_is_told_to_stop_finishes_and_then_the_port_is_free():
    async def scenario():
        release = asyncio.Event()

        async def app(scope, receive, send):
            await StreamingResponse(_chunks(release))(scope, receive, send)

        port = free_port()
        server = IngressHttpServer(app, "127.0.0.1", port, graceful_timeout_s=10)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            async with http.stream("GET", "/anything") as response:
                lines = response.aiter_lines()
                assert await anext(lines) == "first"
                stopping = asyncio.create_task(server.stop())
                await asyncio.sleep(0.3)
                assert not stopping.done()  # the probe: the stop waits for the open stream
                assert server.failure() is None  # told to stop: not a failure
                release.set()
                assert await anext(lines) == "last"
            await asyncio.wait_for(stopping, 10)
            with pytest.raises(httpx.ConnectError):
                await http.get("/anything")

    asyncio.run(scenario())


def test_a_server_that_stops_by_itself_says_why():
    async def scenario():
        async def app(scope, receive, send):
            pass

        port = free_port()
        server = IngressHttpServer(app, "127.0.0.1", port, graceful_timeout_s=1)
        await asyncio.sleep(0.2)
        assert server.failure() is None
        server._task.cancel()  # what a crash of the serving task looks like from outside
        await asyncio.sleep(0)
        assert server.failure() == f"the HTTP server on 127.0.0.1:{port} stopped: it exited"

    asyncio.run(scenario())


class _FailingIngress:
    """An ingress whose request handling raises (a bug in its own code)."""

    _serve_http = FleetIngress._serve_http

    async def __call__(self, request):
        raise KeyError("a bug's detail the client must not see")


def test_an_ingress_failure_on_a_request_is_an_openai_500_with_no_traceback(caplog):
    async def scenario():
        ingress = _FailingIngress()
        port = free_port()
        server = IngressHttpServer(ingress._serve_http, "127.0.0.1", port, graceful_timeout_s=1)
        try:
            async with httpx.AsyncClient(timeout=10) as http:
                return await http.post(f"http://127.0.0.1:{port}/v1/completions", json={})
        finally:
            await server.stop()

    response = asyncio.run(scenario())
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == 500 and "ingress failed on this request" in error["message"]
    assert "Traceback" not in response.text and "bug's detail" not in response.text
    # The probe: the failure happened, and the log has it with its traceback.
    logged = [r for r in caplog.records if "POST /v1/completions failed" in r.getMessage()]
    assert logged and logged[0].exc_info is not None
    assert "bug's detail" in json.dumps(str(logged[0].exc_info[1]))


def test_the_ingress_serves_its_routes_on_its_own_port_and_stops_serving_when_deleted(
        tiny_model):
    from engine.fleet.asgi_bridge import ResponseStart
    from tests.utils.fleet_ingress import FakeStream, start_ingress

    async def scenario():
        answer = FakeStream([ResponseStart(status=200, headers=[(b"content-type",
                                                                 b"application/json")]),
                             b'{"ok": true}'])
        ingress = await start_ingress(tiny_model(), [answer])
        url = f"http://127.0.0.1:{ingress.settings.port}"
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            response = await http.post("/v1/completions", json={
                "model": "m", "prompt": "hello there", "max_tokens": 2})
            assert response.status_code == 200 and response.json() == {"ok": True}
            assert len(ingress.engine.calls) == 1  # the probe: it went through the ingress
            await ingress.check_health()
            # What Ray Serve calls (and awaits) when it stops the ingress.
            assert hasattr(ingress, "__del__")
            await ingress.__del__()
            with pytest.raises(httpx.ConnectError):
                await http.get("/v1/models")

    asyncio.run(scenario())


def test_the_ingress_forwards_the_arrival_of_the_request_s_first_bytes(tiny_model):
    """A request whose line reaches the ingress HOLD_S before the rest: the arrival the replica
    and the router count its TTFT from is its first bytes' (engine.serving.arrival), not the
    moment the ingress's app took it up."""
    import time

    from engine.fleet.asgi_bridge import ResponseStart
    from tests.utils.fleet_ingress import FakeStream, start_ingress

    hold_s = 0.4
    body = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 2,
                       "ttft_slo_ms": 60_000}).encode()

    async def scenario():
        answer = FakeStream([ResponseStart(status=200, headers=[(b"content-type",
                                                                 b"application/json")]),
                             b'{"ok": true}'])
        ingress = await start_ingress(tiny_model(), [answer])
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", ingress.settings.port)
            sent_at = time.time()
            writer.write(b"POST /v1/completions HTTP/1.1\r\n")
            await asyncio.sleep(hold_s)
            writer.write(b"Host: fleet\r\nContent-Type: application/json\r\nConnection: close"
                         b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            response = await reader.read()
            writer.close()
        finally:
            await ingress.__del__()
        return sent_at, response, ingress.engine.calls

    sent_at, response, calls = asyncio.run(scenario())
    assert response.startswith(b"HTTP/1.1 200"), response
    ((forwarded, hint),) = calls
    assert abs(forwarded.arrived_at - sent_at) < hold_s / 4, forwarded.arrived_at - sent_at
    assert hint is not None and hint.arrived_at == forwarded.arrived_at
