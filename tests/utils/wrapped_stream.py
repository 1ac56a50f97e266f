"""A request's output stream (engine.ipc.async_client.RequestStream) seen through a change a
test server makes to each output; closing it closes the request's, so a client that went away
still aborts its request."""

from __future__ import annotations

from engine.ipc.async_client import RequestStream
from engine.outputs import RequestOutput


class WrappedStream:
    def __init__(self, stream: RequestStream) -> None:
        self.stream = stream

    async def changed(self, out: RequestOutput) -> RequestOutput:
        """The output as the test server's response sees it."""
        raise NotImplementedError

    def __aiter__(self) -> WrappedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        return await self.changed(await self.stream.__anext__())

    def close(self) -> None:
        self.stream.close()

    async def aclose(self) -> None:
        self.close()
