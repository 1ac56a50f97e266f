"""A fleet's replica prefills the token ids its ingress rendered to route a request, rather than
tokenizing the text again (engine.serving.forwarded_prompts): through the replica's bridge
(engine.fleet.asgi_bridge.call_app) into the server's own app, with a fake EngineCore that
records what it was asked to prefill. The forwarded ids here differ from the text's own
tokenization on purpose, so that which of the two reached the engine shows."""

from __future__ import annotations

import asyncio
import json

from transformers import AutoTokenizer

from engine.fleet.asgi_bridge import ForwardedRequest, ResponseStart, call_app
from tests.utils.inprocess_server import FakeCore, started_app
from tests.utils.server_helpers import copy_with_chat_template


def _prefilled(model: str, path: str, body: dict,
               prompt_token_ids: list[list[int]] | None) -> tuple[int, list[list[int]]]:
    """The response's status, and the prompt ids of each engine request the app made."""
    fake = FakeCore(len(AutoTokenizer.from_pretrained(model)), max_model_len=512)

    async def run() -> int:
        async with started_app(model, fake=fake, max_model_len=512) as app:
            request = ForwardedRequest(
                method="POST", path=path, headers=[(b"content-type", b"application/json")],
                body=json.dumps(body).encode(), prompt_token_ids=prompt_token_ids)
            parts = [part async for part in call_app(app, request)]
        assert isinstance(parts[0], ResponseStart)
        return parts[0].status

    status = asyncio.run(run())
    return status, [list(r.prompt_token_ids) for r in fake.requests]


def test_a_chat_turn_prefills_the_ids_its_ingress_rendered(tiny_model, tmp_path):
    model = copy_with_chat_template(tiny_model(), tmp_path / "chat-model")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 1}
    forwarded = [[7, 8, 9, 10, 11]]

    status, own = _prefilled(model, "/v1/chat/completions", body, None)
    assert status == 200 and own[0] != forwarded[0]  # probe: the app's own rendering differs
    status, used = _prefilled(model, "/v1/chat/completions", body, forwarded)
    assert status == 200 and used == forwarded
    # A Responses request is the chat request it amounts to: one prompt, forwarded alike.
    status, used = _prefilled(model, "/v1/responses",
                              {"model": "tiny", "input": "hello there", "max_output_tokens": 1},
                              forwarded)
    assert status == 200 and used == forwarded


def test_completion_text_prompts_prefill_the_forwarded_ids_in_order(tiny_model):
    model = tiny_model()
    body = {"model": "tiny", "prompt": ["hello there", "a second prompt"], "max_tokens": 1}
    forwarded = [[5, 6, 7], [8, 9]]

    status, own = _prefilled(model, "/v1/completions", body, None)
    assert status == 200 and sorted(own) != sorted(forwarded)  # probe: the text's own ids
    status, used = _prefilled(model, "/v1/completions", body, forwarded)
    assert status == 200 and sorted(used) == sorted(forwarded)


def test_ids_that_do_not_match_the_body_are_not_used(tiny_model):
    """The ingress read the body otherwise (a different number of prompts): the app tokenizes
    the text itself, and token-id prompts are the client's own either way."""
    model = tiny_model()
    text = {"model": "tiny", "prompt": ["hello there", "a second prompt"], "max_tokens": 1}
    _, own = _prefilled(model, "/v1/completions", text, None)
    _, miscounted = _prefilled(model, "/v1/completions", text, [[5, 6, 7]])
    assert sorted(miscounted) == sorted(own)

    ids = {"model": "tiny", "prompt": [3, 4, 5, 6], "max_tokens": 1}
    _, used = _prefilled(model, "/v1/completions", ids, [[9, 9]])
    assert used == [[3, 4, 5, 6]]

