"""A request's arrival is stamped as its first bytes are read (engine.serving.arrival), not when
its app starts: what lies between (the rest of its bytes, the event loop's backlog) is time
its client waits. A client here sends the request line, then the rest of the request HOLD_S
later; with the stamping protocol the app sees the arrival HOLD_S before itself, and with
uvicorn's own protocol (the probe) it sees it at its own start."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn

from engine.ports import free_port
from engine.serving.arrival import ARRIVAL, ArrivalStamp, http_protocol

HOLD_S = 0.4


async def _report_arrival(scope, receive, send) -> None:
    """Answers with how long before the app's start the request arrived."""
    started = time.monotonic()
    while (await receive()).get("more_body"):
        pass
    body = json.dumps({"arrived_before_app_s": started - scope["state"][ARRIVAL]}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _serve(http) -> tuple[uvicorn.Server, threading.Thread, int]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(ArrivalStamp(_report_arrival), host="127.0.0.1",
                                           port=port, http=http, lifespan="off",
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    return server, thread, port


def _held_request(port: int) -> dict:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /x HTTP/1.1\r\n")
        time.sleep(HOLD_S)
        sock.sendall(b"Host: 127.0.0.1\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        response = b""
        while chunk := sock.recv(65536):
            response += chunk
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), response
    return json.loads(body)


@pytest.mark.parametrize("stamped_by", ["protocol", "app (probe)"])
def test_the_arrival_is_the_request_s_first_bytes(stamped_by):
    server, thread, port = _serve(http_protocol() if stamped_by == "protocol" else "httptools")
    try:
        arrived_before = _held_request(port)["arrived_before_app_s"]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    if stamped_by == "protocol":
        assert arrived_before >= HOLD_S * 0.9, arrived_before
    else:
        assert arrived_before < HOLD_S / 2, arrived_before
