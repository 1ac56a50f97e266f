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
    on the short lane's thread, and the short turn on the event loop's own, with the short
    lane's tokenizer and the GIL held (InputProcessor.holding_gil)."""
    entered, release = threading.Event(), threading.Event()
    # "long" / "short" / "inline" -> (thread name, tokenizer id, whether it holds the GIL)
    seen: dict[str, tuple[str, int, bool]] = {}
    encode = InputProcessor.encode
    template = InputProcessor.apply_chat_template

    def record(processor: InputProcessor, size: int) -> None:
        kind = ("long" if size >= LONG_INPUT_CHARS else "short" if size >= INLINE_INPUT_CHARS
                else "inline")
        seen[kind] = (threading.current_thread().name, id(processor.tokenizer),
                      processor._backend is not None)
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
            short_tokenizer = id(engine.inputs.tokenizer)
            loop_thread = threading.current_thread().name
        assert seen["inline"] == (loop_thread, short_tokenizer, True)
        assert seen["short"] == ("sloserve-tokenize_0", short_tokenizer, False)
        assert seen["long"][0] == "sloserve-tokenize-long_0"
        assert seen["long"][1] != short_tokenizer  # its own: never shared across threads
        assert not seen["long"][2]

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


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TEXTS = ["Hello world", " a leading space\n\nand <s> </s> <|im_start|> in the text",
         "éè 日本語 🙂 " * 40, "x"]


def _tokenizer_folders(model_dir, tmp_path) -> list[str]:
    """The test model's tokenizer (with a chat template), the default model's (SmolLM2's), and
    a byte-level BPE trained here."""
    from engine.benchmarks.inputs.random_checkpoints import save_small_tokenizer
    from engine.entrypoints.default_model import model_path_or_default

    return [model_dir, str(model_path_or_default(None)),
            str(save_small_tokenizer(tmp_path / "small"))]


def test_encoding_with_the_gil_held_gives_the_tokenizers_own_ids(model_dir, tmp_path) -> None:
    """InputProcessor.holding_gil encodes through the fast tokenizer's backend: the ids of
    plain text (with and without special tokens) and of chat messages (tools included) are
    the tokenizer's own calls' (apply_chat_template with tokenize=True), on every tokenizer.
    The probe that it took the other way: the view has the backend, the processor not."""
    for folder in _tokenizer_folders(model_dir, tmp_path):
        inputs = InputProcessor(folder)
        holding = inputs.holding_gil()
        tokenizer = inputs.tokenizer
        assert holding._backend is not None and inputs._backend is None, folder
        assert holding.tokenizer is tokenizer  # shared, not loaded again
        for text in TEXTS:
            for special in (True, False):
                expected = list(tokenizer.encode(text, add_special_tokens=special))
                assert inputs.encode(text, special) == expected, (folder, text)
                assert holding.encode(text, special) == expected, (folder, text)
            if not getattr(tokenizer, "chat_template", None):
                continue
            messages = [{"role": "system", "content": "be brief"},
                        {"role": "user", "content": text}]
            for tools in (None, TOOLS):
                expected = list(tokenizer.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=True, tokenize=True,
                    return_dict=False))
                assert inputs.apply_chat_template(messages, True, tools) == expected
                assert holding.apply_chat_template(messages, True, tools) == expected


def test_a_chat_template_error_is_still_bad_input_when_holding_the_gil(model_dir) -> None:
    inputs = InputProcessor(model_dir)
    inputs.tokenizer.chat_template = "{{ raise_exception('only user turns, please') }}"
    with pytest.raises(ValueError, match="the chat template rejected them: only user turns"):
        inputs.holding_gil().apply_chat_template([{"role": "user", "content": "hi"}], True, None)


def test_encoding_with_the_gil_held_lets_no_other_thread_run(model_dir) -> None:
    """The point of holding_gil: while it encodes, the process's other Python threads do not
    run (the loop never has to win the GIL back from them). The probe: a thread that counts
    without pause advances while the tokenizer's own call encodes a long text, and stands
    still (a few counts at most, around the Rust call) while holding_gil encodes it."""
    inputs = InputProcessor(model_dir)
    holding = inputs.holding_gil()
    text = "lorem ipsum dolor sit amet " * 40_000
    counter = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counter[0] += 1

    thread = threading.Thread(target=count, daemon=True)
    thread.start()
    try:
        def advance(encode) -> int:
            before = counter[0]
            encode(text)
            return counter[0] - before

        released = advance(lambda t: inputs.tokenizer.encode(t))
        held = advance(holding.encode)
    finally:
        stop.set()
        thread.join()
    assert released > 1000, f"the counting thread never ran beside the release ({released})"
    assert held * 20 < released, (held, released)


def test_short_inputs_are_encoded_inline_with_the_gil_held(model_dir) -> None:
    """Below INLINE_INPUT_CHARS the work gets the lanes' GIL-holding view of the short lane's
    processor; a longer input gets the lane's own processor, on the lane's thread."""
    from engine.serving.tokenize_lanes import TokenizeLanes

    short = InputProcessor(model_dir)
    lanes = TokenizeLanes(short, lambda: InputProcessor(model_dir))
    seen: list[tuple[InputProcessor, str]] = []

    def work(inputs: InputProcessor) -> None:
        seen.append((inputs, threading.current_thread().name))

    async def run() -> None:
        await lanes.on_lane(INLINE_INPUT_CHARS - 1, work)
        await lanes.on_lane(INLINE_INPUT_CHARS, work)

    try:
        asyncio.run(run())
    finally:
        lanes.shutdown()
    (inline, inline_thread), (lane, lane_thread) = seen
    assert inline._backend is not None and inline.tokenizer is short.tokenizer
    assert inline_thread == "MainThread"
    assert lane is short and lane_thread.startswith("sloserve-tokenize")
