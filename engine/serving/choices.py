"""Running the engine requests of one HTTP request (one per prompt and sample) together: their
outputs merged into one stream, or gathered once all are finished, and all of them aborted when
the client goes away or one of them fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import suppress

from fastapi import Request

from engine.outputs import RequestOutput

_DONE = object()


async def merged(sources: list[AsyncIterator[RequestOutput]]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(position of the source, its latest output) as each source advances. An exception from
    any source ends the merge with it; leaving early (or failing) closes every source, which
    aborts its request in the engine."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(position: int, source: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in source:
                queue.put_nowait((position, out))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(_DONE)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(sources)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for source in sources:
            with suppress(Exception):
                await source.aclose()


async def finals_unless_disconnected(sources: list[AsyncIterator[RequestOutput]],
                                     request: Request) -> list[RequestOutput] | None:
    """Every source's last output, or None if the client went away first (every request is
    then aborted). The first exception of any source is raised, after the others are closed."""

    async def drain() -> list[RequestOutput]:
        last: list[RequestOutput | None] = [None] * len(sources)
        async for position, out in merged(sources):
            last[position] = out
        assert all(out is not None for out in last), "a request ended without an output"
        return last  # type: ignore[return-value]

    task = asyncio.create_task(drain())
    try:
        while True:
            done, _ = await asyncio.wait([task], timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
