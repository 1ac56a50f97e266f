"""Running the engine requests of one HTTP request (one per prompt and sample) together: their
outputs merged into one stream, or gathered once all are finished, and all of them aborted when
the client goes away or one of them fails."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from engine.ipc.async_client import AsyncEngineClient, RequestStream
from engine.outputs import RequestOutput, best_samples
from engine.sampling_params import SamplingParams
from engine.serving.openai_responses import Choice

_DONE = object()


@dataclass
class EnginePrompt:
    """One prompt of an HTTP request, ready for the engine."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams
    # echo: the prompt's text and its first token's (which has no score).
    echo_text: str = ""
    first_token_text: str = ""


def fan_out(client: AsyncEngineClient, request_id: str, prompts: list[EnginePrompt],
            per_prompt: int, **generate_args: Any
            ) -> tuple[list[Choice], list[RequestStream], list[str]]:
    """One engine request per prompt and sample (choice ``p * per_prompt + i``), each handed to
    the engine at once: the choices, their output streams (whoever holds them closes them,
    which aborts what has not finished) and their request ids. A prompt's later samples wait
    for its first one's prefill (SiblingGate)."""
    choices: list[Choice] = []
    sources: list[RequestStream] = []
    request_ids: list[str] = []
    single = len(prompts) * per_prompt == 1
    try:
        for p, prompt in enumerate(prompts):
            leader: str | None = None
            for sample in range(per_prompt):
                index = p * per_prompt + sample
                child_id = request_id if single else f"{request_id}-{index}"
                choices.append(Choice(index=index, prompt_index=p,
                                      prompt_text=prompt.echo_text,
                                      first_prompt_token=prompt.first_token_text))
                params = prompt.params.child(sample) if per_prompt > 1 else prompt.params
                sources.append(client.generate(child_id, prompt.text, prompt.token_ids, params,
                                               prefill_after=leader, **generate_args))
                request_ids.append(child_id)
                leader = leader or child_id
    except BaseException:  # the engine is gone: what was handed over is aborted
        for source in sources:
            source.close()
        raise
    return choices, sources, request_ids


def best_of_choices(choices: list[Choice], finals: list[RequestOutput], n: int,
                    keep_logprobs: bool) -> tuple[list[Choice], list[RequestOutput]]:
    """best_of: each prompt's n best samples, as choices p * n .. p * n + n - 1."""
    kept_choices: list[Choice] = []
    kept: list[RequestOutput] = []
    for p in sorted({c.prompt_index for c in choices}):
        group = [o for c, o in zip(choices, finals) if c.prompt_index == p]
        template = next(c for c in choices if c.prompt_index == p)
        for i, out in enumerate(best_samples(group, n, keep_logprobs)):
            kept_choices.append(dataclasses.replace(template, index=p * n + i))
            kept.append(out)
    return kept_choices, kept


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
                                     request: Request,
                                     on_output: Callable[[int, RequestOutput], None]
                                     ) -> list[RequestOutput] | None:
    """Every source's last output, or None if the client went away first (every request is
    then aborted). The first exception of any source is raised, after the others are closed.
    ``on_output`` sees (position, output) as each output arrives."""

    async def drain() -> list[RequestOutput]:
        last: list[RequestOutput | None] = [None] * len(sources)
        async for position, out in merged(sources):
            on_output(position, out)
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
