"""`python -m tests.utils.silent_first_token serve ...`: the server with the text of each request's
first output token blanked, as a special token (`<|im_end|>` under `ignore_eos`), a partial
UTF-8 sequence or text held back for a stop string would leave it: the engine has sampled a
token, the client is sent nothing (tests/entrypoints/test_http_first_output.py). The later tokens' text is
the model's, from the second token on."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import AsyncIterator

from engine.ipc.async_client import AsyncEngineClient
from engine.outputs import RequestOutput

_generate = AsyncEngineClient.generate


async def _silent_first_generate(self: AsyncEngineClient, *args, **kwargs
                                 ) -> AsyncIterator[RequestOutput]:
    outputs = _generate(self, *args, **kwargs)
    try:
        silent = 0  # characters of the first token's text, never shown
        async for out in outputs:
            if len(out.token_ids) == 1:
                silent = len(out.text)
            yield dataclasses.replace(out, text=out.text[silent:])
    finally:
        await outputs.aclose()  # a client that went away still aborts its request


if __name__ == "__main__":  # not on import: EngineCore's spawned process imports this module
    from engine.entrypoints.cli import main

    AsyncEngineClient.generate = _silent_first_generate  # type: ignore[method-assign]
    sys.exit(main())
