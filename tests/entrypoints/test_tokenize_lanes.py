"""The API server's tokenization lanes (engine/serving/tokenize_lanes.py): a turn is never
queued behind a document's tokenization, and a grammar already checked is not checked again."""

from __future__ import annotations

import asyncio
import threading

import pytest

import engine.serving.serving_engine
from engine.processing.input_processor import InputProcessor
from engine.serving.tokenize_lanes import INLINE_INPUT_CHARS, LONG_INPUT_CHARS, text_size
from tests.utils.inprocess_server import FakeCore, app_client
from tests.utils.server_helpers import copy_with_chat_template

C = "/v1/completions"
CH = "/v1/chat/completions"
LONG_CONTEXT = 100_000


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory) -> str:
    return copy_with_chat_template(tiny_model("llama"),
                                   tmp_path_factory.mktemp("lanes") / "tiny-chat")


@pytest.fixture(scope="module")
def vocab_size(model_dir) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(model_dir))


def test_text_size_counts_every_string_in_messages() -> None:
    messages = [{"role": "user", "content": "abc"},
                {"role": "assistant", "content": [{"type": "text", "text": "de"}]}]
    assert text_size(messages) == len("user") + 3 + len("assistant") + len("text") + 2
    assert text_size("x" * 10) == 10 and text_size(None) == 0


@pytest.mark.parametrize("route", [C, CH])
def test_a_turn_is_not_queued_behind_a_documents_tokenization(model_dir, vocab_size,
                                                               monkeypatch, route) -> None:
    """While a document's tokenization is stuck (a stand-in for a 30k-token text: 109 ms on
    this CPU), a short turn and a longer one are tokenized and served; then the document is
    too. The probes: the document really was inside the tokenizer while the turns were served,
    on the long lane's thread, with a tokenizer other than the short lane's; the longer turn
    on the short lane's thread, and the short turn on the event loop's own."""
    entered, release = threading.Event(), threading.Event()
    seen: dict[str, tuple[str, int]] = {}  # "long" / "short" -> (thread name, processor id)
    encode = InputProcessor.encode
    template = InputProcessor.apply_chat_template

    def record(processor: InputProcessor, size: int) -> None:
        kind = ("long" if size >= LONG_INPUT_CHARS else "short" if size >= INLINE_INPUT_CHARS
                else "inline")
        seen[kind] = (threading.current_thread().name, id(processor))
        if kind == "long":
            entered.set()
            release.wait(timeout=30)  # only keeps a broken build from hanging the suite

    def slow_encode(self, prompt, add_special_tokens=True):
        record(self, len(prompt))
        return encode(self, prompt, add_special_tokens)

    def slow_template(self, messages, add_generation_prompt=True, tools=None,
                      template_kwargs=None):
        record(self, text_size(messages))
        return template(self, messages, add_generation_prompt, tools, template_kwargs)

    monkeypatch.setattr(InputProcessor, "encode", slow_encode)
    monkeypatch.setattr(InputProcessor, "apply_chat_template", slow_template)
    document = "lorem ipsum " * (LONG_INPUT_CHARS // 12 + 1)

    def body(text: str) -> dict:
        if route == C:
            return {"prompt": text, "max_tokens": 1}
        return {"messages": [{"role": "user", "content": text}], "max_tokens": 1}

    async def run() -> None:
        fake = FakeCore(vocab_size, max_model_len=LONG_CONTEXT)
        async with app_client(model_dir, fake=fake) as (http, engine):
            stuck = asyncio.create_task(http.post(route, json=body(document)))
            assert await asyncio.to_thread(entered.wait, 30)  # probe: inside the tokenizer
            turn = await http.post(route, json=body("a short urgent turn"))
            assert turn.status_code == 200, turn.text
            longer = await http.post(route, json=body("a longer turn " * (
                INLINE_INPUT_CHARS // 14 + 1)))
            assert longer.status_code == 200, longer.text
            assert not stuck.done(), "the turns were served only after the document"
            release.set()
            response = await stuck
            assert response.status_code == 200, response.text
            assert len(fake.requests) == 3
            assert len(fake.requests[0].prompt_token_ids) < 64  # the turn reached the core first
            short_inputs = id(engine.inputs)
            loop_thread = threading.current_thread().name
        assert seen["inline"] == (loop_thread, short_inputs)
        assert seen["short"] == ("sloserve-tokenize_0", short_inputs)
        assert seen["long"][0] == "sloserve-tokenize-long_0"
        assert seen["long"][1] != short_inputs  # its own tokenizer: never shared across threads

    asyncio.run(run())


def test_a_checked_grammar_is_not_checked_again(model_dir, vocab_size, monkeypatch) -> None:
    """An agent's next turn with the same schema skips the check (a hop off the event loop);
    another schema is checked, and a malformed one is a 400 every time."""
    calls: list[object] = []
    check = engine.serving.serving_engine.grammar_of

    def counted(params):
        calls.append(params)
        return check(params)

    monkeypatch.setattr(engine.serving.serving_engine, "grammar_of", counted)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    malformed = {"type": "object", "properties": {"city": {"type": "strnig"}}}

    def fmt(s: dict) -> dict:
        return {"type": "json_schema", "json_schema": {"name": "w", "schema": s}}

    async def run() -> None:
        async with app_client(model_dir, fake=FakeCore(vocab_size)) as (http, _):
            for _ in range(3):
                r = await http.post(CH, json={"messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 2, "response_format": fmt(schema)})
                assert r.status_code == 200, r.text
            assert len(calls) == 1
            for _ in range(2):
                r = await http.post(CH, json={"messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 2, "response_format": fmt(malformed)})
                assert r.status_code == 400 and "not valid" in r.text, r.text
            assert len(calls) == 3

    asyncio.run(run())


def test_the_long_lanes_tokenizer_is_loaded_as_the_server_starts(model_dir) -> None:
    """The long lane builds its tokenizer when the lanes are made, on its own thread, not when
    the first document arrives (in a flood, every API server of a fleet paid that load at
    once). The probe: the loader ran, on the long lane's thread, before any input was given;
    the first document then reuses what it built."""
    from engine.serving.tokenize_lanes import TokenizeLanes

    loaded = threading.Event()
    loads: list[str] = []

    def load() -> InputProcessor:
        loads.append(threading.current_thread().name)
        loaded.set()
        return InputProcessor(model_dir)

    short = InputProcessor(model_dir)
    lanes = TokenizeLanes(short, load)
    try:
        assert loaded.wait(timeout=30), "the long lane never loaded its tokenizer"
        assert loads == [loads[0]] and loads[0].startswith("sloserve-tokenize-long")
        document = "lorem ipsum " * (LONG_INPUT_CHARS // 12 + 1)
        ids = asyncio.run(lanes.encode(document))
        assert ids == short.encode(document) and len(loads) == 1
    finally:
        lanes.shutdown()
