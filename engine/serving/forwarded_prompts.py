"""Prompts a fleet's ingress has already tokenized, handed to the replica's server with them.

A fleet's ingress renders every generation request to route it (engine.fleet.ingress: the
router ranks replicas by the prompt's length and prefix-block hashes), through the same
functions this server renders with (engine.serving.chat_prompt, InputProcessor.encode) and the
same tokenizer. The replica's bridge (engine.fleet.asgi_bridge) puts those token ids in the
request's ASGI state, which no client can set, and the routes use them instead of tokenizing
the text a second time. In a flood of 8k-16k-token documents through three replicas on a 2-core
host their API servers spent 0.14-0.15 CPU seconds per document, and 0.07 once the ids came
with it (bench/RESULTS.md, Overload): time taken from every other request on the machine.
"""

from __future__ import annotations

from starlette.requests import Request

# The key of `scope["state"]` (`request.state.<key>`) that holds them: one list of token ids per
# prompt of the request, in the body's order.
FORWARDED_PROMPTS_STATE = "forwarded_prompt_token_ids"


def forwarded_prompts(request: Request, count: int) -> list[list[int]] | None:
    """The token ids of the request's `count` prompts as its fleet's ingress rendered them;
    None on a single server, or when the ingress's reading of the body does not match the
    route's (then the route tokenizes them itself)."""
    prompts = getattr(request.state, FORWARDED_PROMPTS_STATE, None)
    if prompts is None or len(prompts) != count:
        return None
    return prompts
