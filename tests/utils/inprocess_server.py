"""The API server app in this process (httpx's ASGI transport, the app's own lifespan), with
either the real EngineCore process behind it or `FakeCore`: a thread that plays EngineCore over
the real channel (handshake, CoreReady, scripted answers), so that the server's error paths can
be driven without a model and without timing."""

from __future__ import annotations

import asyncio

import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import msgspec
from fastapi import FastAPI

from engine.serving.api_server import ServerSettings, build_app
from engine.ipc.async_client import AsyncEngineClient
from engine.config import build_engine_config
from engine.ipc.core_launch import CoreLaunch
from engine.ipc.core_messages import (AbortRequests, AddRequest, CoreHello, CoreOutputs,
                                      CoreReady, FirstOutputDelivered, FrameSocket,
                                      ShutdownCore, start_decoder, to_core_decoder)
from engine.outputs import EngineCoreOutput, SchedulerStats

MAX_MODEL_LEN = 64

# What the fake core answers to one AddRequest: the frames to send (a number among them: wait
# that many seconds before the next), and whether to hang up after them (as the real core does
# after CoreFailed).
Script = Callable[[AddRequest], tuple[list[msgspec.Struct | float], bool]]


def finish_with_one_token(message: AddRequest) -> tuple[list[msgspec.Struct], bool]:
    out = EngineCoreOutput(req_id=message.request_id, new_token_ids=[5], finish_reason="length")
    return [CoreOutputs(outputs=[out], stats=SchedulerStats())], False


class FakeCore:
    """Stands in for the EngineCore process: `launch` replaces AsyncEngineClient._launch_core
    and the object itself answers the process interface the client uses (is_alive, join, ...)."""

    def __init__(self, vocab_size: int, script: Script = finish_with_one_token,
                 max_model_len: int = MAX_MODEL_LEN) -> None:
        self.vocab_size, self.script, self.max_model_len = vocab_size, script, max_model_len
        self.thread: threading.Thread | None = None
        self.sock: socket.socket | None = None
        self.requests: list[AddRequest] = []
        # The API server's notes that a request's first visible output was written.
        self.delivered: list[FirstOutputDelivered] = []
        # The ids of every request the API server aborted, in order.
        self.aborted: list[str] = []
        # When each frame went out (time.monotonic()), in order: stamped just before the send,
        # since the server can read and answer a frame before this thread runs again.
        self.sent_at: list[float] = []

    def launch(self) -> CoreLaunch:
        launch = CoreLaunch.listen()
        self.sock = socket.create_connection(("127.0.0.1", launch.port))
        self.thread = threading.Thread(target=self._run, args=(launch.token,), daemon=True)
        self.thread.start()
        launch.process = self  # type: ignore[assignment]
        return launch

    def _run(self, token: bytes) -> None:
        channel = FrameSocket(self.sock)
        try:
            channel.send(CoreHello(token=token))
            while not (frames := channel.receive(timeout=None)):
                if frames is None:
                    return
            start_decoder.decode(frames[0])  # what to build: nothing, here
            channel.send(CoreReady(max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                                   num_blocks=8))
            while (frames := channel.receive(timeout=None)) is not None:
                for payload in frames:
                    message = to_core_decoder.decode(payload)
                    if isinstance(message, ShutdownCore):
                        return
                    if isinstance(message, FirstOutputDelivered):
                        self.delivered.append(message)
                    if isinstance(message, AbortRequests):
                        self.aborted.extend(message.request_ids)
                    if isinstance(message, AddRequest):
                        self.requests.append(message)
                        replies, hang_up = self.script(message)
                        for reply in replies:
                            if isinstance(reply, float):
                                time.sleep(reply)
                                continue
                            self.sent_at.append(time.monotonic())
                            channel.send(reply)
                        if hang_up:
                            return
        except OSError:
            pass
        finally:
            self.sock.close()

    # ---- the process interface --------------------------------------------------------------

    def is_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    @property
    def exitcode(self) -> int | None:
        return None if self.is_alive() else 0

    def join(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def terminate(self) -> None:
        if self.sock is not None:
            self.sock.close()

    kill = terminate


@asynccontextmanager
async def started_app(model_dir: str, settings: ServerSettings | None = None,
                      fake: FakeCore | None = None,
                      launch_core: Callable[[], CoreLaunch] | None = None, **engine_args
                      ) -> AsyncIterator[FastAPI]:
    """The app started through its own lifespan. `fake` replaces the EngineCore process;
    `launch_core` replaces the real launch; `engine_args` go to build_engine_config."""
    settings = settings or ServerSettings(served_model_name="tiny")
    engine_args = {"max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 16, **engine_args}
    config = build_engine_config(model_dir, dtype="float32", **engine_args)
    app = build_app(config, settings)
    engine: AsyncEngineClient = app.state.client
    if fake is not None:
        engine._launch_core = fake.launch  # type: ignore[method-assign]
    elif launch_core is not None:
        engine._launch_core = launch_core  # type: ignore[method-assign]
    async with app.router.lifespan_context(app):
        yield app


@asynccontextmanager
async def app_client(model_dir: str, settings: ServerSettings | None = None,
                     fake: FakeCore | None = None,
                     launch_core: Callable[[], CoreLaunch] | None = None, **engine_args
                     ) -> AsyncIterator[tuple[httpx.AsyncClient, AsyncEngineClient]]:
    """The app started through its own lifespan (started_app); yields an httpx client on it
    and the app's engine client."""
    async with started_app(model_dir, settings, fake, launch_core, **engine_args) as app:
        engine: AsyncEngineClient = app.state.client
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://sloserve",
                                     timeout=60) as http:
            yield http, engine


def run_with_sdk(model_dir: str, calls, settings: ServerSettings, **engine_args):
    """Each of `calls`, awaited in turn as `call(sdk, http)` against one app: the openai SDK's
    async client and the raw httpx client on the same app. Returns their results."""
    import openai

    async def go():
        async with app_client(model_dir, settings, **engine_args) as (http, _):
            sdk = openai.AsyncOpenAI(base_url="http://sloserve/v1", api_key="none",
                                     http_client=http)
            return [await call(sdk, http) for call in calls]

    return asyncio.run(go())
