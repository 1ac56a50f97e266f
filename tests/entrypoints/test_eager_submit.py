"""A request is handed to EngineCore when the server has its token ids, not when its response
first reads the engine's outputs (engine.ipc.async_client.RequestStream): under a flood that
read comes tens of ms later. So a stream is closed by whoever holds it, and closing one before
its end aborts the request in the core, whether it was ever read or not."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from engine.sampling_params import SamplingParams
from tests.utils.inprocess_server import FakeCore, app_client


@pytest.fixture(scope="module")
def tiny_llama(tiny_model) -> tuple[str, int]:
    """The tiny Llama's folder and its vocabulary's size (what FakeCore tells the server)."""
    from transformers import AutoTokenizer

    folder = tiny_model("llama")
    return folder, len(AutoTokenizer.from_pretrained(folder))


def never_answer(message):
    return [], False


async def _until(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.01)


def test_a_request_reaches_the_core_before_its_stream_is_read(tiny_llama) -> None:
    """generate() sends the request at once; closing the stream unread aborts it there, and
    leaves nothing of it in the client. A stream read to its end aborts nothing."""

    model_dir, vocab_size = tiny_llama

    async def run() -> None:
        fake = FakeCore(vocab_size, script=never_answer)
        async with app_client(model_dir, fake=fake) as (_, engine):
            params = SamplingParams(max_tokens=4)
            stream = engine.generate("unread", None, [1, 2, 3], params,
                                     arrival_time=time.monotonic())
            # Probe: in the core, though nothing has read the stream.
            await _until(lambda: [r.request_id for r in fake.requests] == ["unread"],
                         "the request reached the core")
            assert "unread" in engine._queues
            stream.close()
            await _until(lambda: fake.aborted == ["unread"], "the unread request was aborted")
            assert "unread" not in engine._queues
            stream.close()  # idempotent: no second abort
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()

        fake = FakeCore(vocab_size)  # answers each request with one finishing token
        async with app_client(model_dir, fake=fake) as (_, engine):
            stream = engine.generate("read", None, [1, 2, 3], SamplingParams(max_tokens=1),
                                     arrival_time=time.monotonic())
            outputs = [out async for out in stream]
            assert outputs[-1].finished and len(outputs) == 1
            stream.close()
            await asyncio.sleep(0.2)
            assert fake.aborted == [] and "read" not in engine._queues

    asyncio.run(run())


def test_a_reader_waiting_on_a_closed_stream_stops(tiny_llama) -> None:
    model_dir, vocab_size = tiny_llama

    async def run() -> None:
        fake = FakeCore(vocab_size, script=never_answer)
        async with app_client(model_dir, fake=fake) as (_, engine):
            stream = engine.generate("waited", None, [1, 2], SamplingParams(max_tokens=4),
                                     arrival_time=time.monotonic())
            reader = asyncio.create_task(anext(stream, "ended"))
            await asyncio.sleep(0.05)
            assert not reader.done()  # probe: it waits on the stream
            stream.close()
            assert await asyncio.wait_for(reader, 5) == "ended"
            await _until(lambda: fake.aborted == ["waited"], "the request was aborted")

    asyncio.run(run())


def test_a_stream_whose_client_left_before_it_was_read_is_aborted(tiny_llama) -> None:
    """A streaming completion whose client is gone when its response starts: the request was in
    the core already (the probe), and the response's end aborts it there."""

    model_dir, vocab_size = tiny_llama

    async def run() -> None:
        fake = FakeCore(vocab_size, script=never_answer)
        async with app_client(model_dir, fake=fake) as (http, engine):
            app = http._transport.app  # type: ignore[attr-defined]
            body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4,
                               "stream": True}).encode()
            messages = [{"type": "http.request", "body": body, "more_body": False}]
            sent: list[dict] = []

            async def receive() -> dict:
                if messages:
                    return messages.pop(0)
                # The client has gone once the server asks for more than the body.
                await _until(lambda: bool(fake.requests), "the request reached the core")
                return {"type": "http.disconnect"}

            async def send(message: dict) -> None:
                sent.append(message)

            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                     "method": "POST", "scheme": "http", "path": "/v1/completions",
                     "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
                     "headers": [(b"host", b"sloserve"), (b"content-type", b"application/json"),
                                 (b"content-length", str(len(body)).encode())],
                     "client": ("127.0.0.1", 1), "server": ("sloserve", 80)}
            await asyncio.wait_for(app(scope, receive, send), 10)
            (request,) = fake.requests
            await _until(lambda: fake.aborted == [request.request_id],
                         "the request of the client that left was aborted")
            assert request.request_id not in engine._queues

    asyncio.run(run())
