"""`python -m tests.utils.silent_first_token serve ...`: the server with the text of each request's
first output token blanked, as a special token (`<|im_end|>` under `ignore_eos`), a partial
UTF-8 sequence or text held back for a stop string would leave it: the engine has sampled a
token, the client is sent nothing (tests/entrypoints/test_http_first_output.py). The later tokens' text is
the model's, from the second token on."""

from __future__ import annotations

import dataclasses
import sys

from engine.ipc.async_client import AsyncEngineClient
from engine.outputs import RequestOutput
from tests.utils.wrapped_stream import WrappedStream

_generate = AsyncEngineClient.generate


class _SilentFirst(WrappedStream):
    silent = 0  # characters of the first token's text, never shown

    async def changed(self, out: RequestOutput) -> RequestOutput:
        if len(out.token_ids) == 1:
            self.silent = len(out.text)
        return dataclasses.replace(out, text=out.text[self.silent:])


def _silent_first_generate(self: AsyncEngineClient, *args, **kwargs) -> _SilentFirst:
    return _SilentFirst(_generate(self, *args, **kwargs))


if __name__ == "__main__":  # not on import: EngineCore's spawned process imports this module
    from engine.entrypoints.cli import main

    AsyncEngineClient.generate = _silent_first_generate  # type: ignore[method-assign]
    sys.exit(main())
