"""`python -m tests.utils.slow_first_output serve ...`: the server with each request's first output
held back SLOSERVE_TEST_FIRST_OUTPUT_DELAY_S seconds after the engine has stamped it and
before the response sees it, as a busy event loop or a slow detokenizer would hold it
(tests/entrypoints/test_http_ttft.py's probe: the engine's stamp cannot see the wait, the client does)."""

from __future__ import annotations

import asyncio
import os
import sys

from engine.ipc.async_client import AsyncEngineClient
from engine.outputs import RequestOutput
from tests.utils.wrapped_stream import WrappedStream

DELAY_ENV = "SLOSERVE_TEST_FIRST_OUTPUT_DELAY_S"
_generate = AsyncEngineClient.generate


class _HeldBack(WrappedStream):
    first = True

    async def changed(self, out: RequestOutput) -> RequestOutput:
        if self.first:
            await asyncio.sleep(float(os.environ[DELAY_ENV]))
            self.first = False
        return out


def _held_back_generate(self: AsyncEngineClient, *args, **kwargs) -> _HeldBack:
    return _HeldBack(_generate(self, *args, **kwargs))


if __name__ == "__main__":  # not on import: tests import DELAY_ENV, EngineCore's process all
    from engine.entrypoints.cli import main

    AsyncEngineClient.generate = _held_back_generate  # type: ignore[method-assign]
    sys.exit(main())
