"""A max_tokens that cannot fit in the context beside its prompt is refused up front, in vLLM's
words: HTTP 400 on /v1/completions and /v1/chat/completions (max_tokens or
max_completion_tokens), ValueError from the offline LLM. The exact fit is served in full, and
a max_tokens left out still means "up to the context"."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, SamplingParams
from engine.processing.input_processor import check_fits_context
from tests.utils.inprocess_server import MAX_MODEL_LEN, app_client
from tests.utils.server_helpers import copy_with_chat_template

PROMPT = list(range(5, 15))  # 10 token ids
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


def message(prompt_len: int, max_tokens: int, what: str = "prompt") -> str:
    """vLLM's text, written out here so that a change to it shows."""
    return (f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {what}, "
            f"{max_tokens} in the completion). Please reduce the length of the {what} or "
            f"completion.")


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory) -> str:
    return copy_with_chat_template(tiny_model("llama", max_position_embeddings=MAX_MODEL_LEN),
                                   tmp_path_factory.mktemp("context-limit") / "tiny-chat")


def test_the_check_names_every_number() -> None:
    check_fits_context(10, MAX_MODEL_LEN - 10, MAX_MODEL_LEN)  # the exact fit passes
    with pytest.raises(ValueError) as info:
        check_fits_context(10, MAX_MODEL_LEN - 9, MAX_MODEL_LEN)
    assert str(info.value) == message(10, MAX_MODEL_LEN - 9)
    with pytest.raises(ValueError) as info:
        check_fits_context(7, 2**62, MAX_MODEL_LEN, messages=True)
    assert str(info.value) == message(7, 2**62, "messages")


# ---- offline ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(model_dir):
    llm = LLM(model=model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("max_tokens", [2**62, MAX_MODEL_LEN - len(PROMPT) + 1])
def test_offline_generate_refuses_what_cannot_fit(llm, max_tokens) -> None:
    good = {"prompt_token_ids": [1, 2, 3]}
    params = [SamplingParams(max_tokens=2, temperature=0),
              SamplingParams(max_tokens=max_tokens, temperature=0)]
    with pytest.raises(ValueError) as info:
        llm.generate([good, {"prompt_token_ids": PROMPT}], params)
    assert str(info.value) == message(len(PROMPT), max_tokens)
    assert not llm.engine.has_unfinished_requests()  # the good one was not stranded
    (out,) = llm.generate(good, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 2


def test_offline_exact_fit_generates_to_the_last_position(llm) -> None:
    room = MAX_MODEL_LEN - len(PROMPT)
    (out,) = llm.generate({"prompt_token_ids": PROMPT},
                          SamplingParams(max_tokens=room, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == room and out.finish_reason == "length"


def test_offline_params_left_out_stop_at_the_context(llm) -> None:
    """The default SamplingParams asks for 16 tokens; with 4 left, the context stops it."""
    long = list(range(5, 5 + MAX_MODEL_LEN - 4))
    (out,) = llm.generate({"prompt_token_ids": long})
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_offline_chat_says_messages(llm) -> None:
    prompt_len = len(llm.apply_chat_template(MESSAGES))
    with pytest.raises(ValueError) as info:
        llm.chat(MESSAGES, SamplingParams(max_tokens=MAX_MODEL_LEN, temperature=0))
    assert str(info.value) == message(prompt_len, MAX_MODEL_LEN, "messages")


# ---- over HTTP (the app in this process, the real EngineCore process behind it) ----------------

def test_the_server_answers_400_and_keeps_serving(model_dir) -> None:
    async def run() -> dict:
        async with app_client(model_dir) as (http, engine):
            got: dict = {}
            tokens = await http.post("/tokenize", json={"messages": MESSAGES})
            chat_len = len(tokens.json()["tokens"])
            got["chat_len"] = chat_len
            completion = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True}
            chat = {"messages": MESSAGES, "temperature": 0, "ignore_eos": True}
            room = MAX_MODEL_LEN - len(PROMPT)
            refused = {
                "huge": ("/v1/completions", {**completion, "max_tokens": 2**62}),
                "one-over": ("/v1/completions", {**completion, "max_tokens": room + 1}),
                "one-over-stream": ("/v1/completions",
                                    {**completion, "max_tokens": room + 1, "stream": True}),
                "chat-huge": ("/v1/chat/completions", {**chat, "max_tokens": 2**62}),
                "chat-one-over": ("/v1/chat/completions",
                                  {**chat, "max_tokens": MAX_MODEL_LEN - chat_len + 1}),
                "chat-completion-tokens": ("/v1/chat/completions",
                                           {**chat, "max_completion_tokens": 2**62}),
                # max_completion_tokens wins over max_tokens, as in the sampling parameters.
                "chat-both": ("/v1/chat/completions",
                              {**chat, "max_tokens": 1, "max_completion_tokens": MAX_MODEL_LEN}),
            }
            for name, (path, body) in refused.items():
                got[name] = await http.post(path, json=body)
            got["nothing-pending"] = not engine._queues
            served = {
                "exact": ("/v1/completions", {**completion, "max_tokens": room}),
                "chat-exact": ("/v1/chat/completions",
                               {**chat, "max_completion_tokens": MAX_MODEL_LEN - chat_len}),
                "chat-left-out": ("/v1/chat/completions", chat),
                # Left out on completions: OpenAI's 16, stopped by the context (4 left).
                "left-out": ("/v1/completions",
                             {**completion, "prompt": list(range(5, 5 + MAX_MODEL_LEN - 4))}),
                # Echo's max_tokens 0 scores a full-context prompt and generates nothing.
                "echo-full": ("/v1/completions", {"prompt": list(range(5, 5 + MAX_MODEL_LEN)),
                                                  "max_tokens": 0, "echo": True}),
                "after": ("/v1/completions", {**completion, "max_tokens": 3}),
            }
            for name, (path, body) in served.items():
                got[name] = await http.post(path, json=body)
            return got

    got = asyncio.run(run())
    chat_len, room = got["chat_len"], MAX_MODEL_LEN - len(PROMPT)
    expected = {
        "huge": (message(len(PROMPT), 2**62), "max_tokens"),
        "one-over": (message(len(PROMPT), room + 1), "max_tokens"),
        "one-over-stream": (message(len(PROMPT), room + 1), "max_tokens"),
        "chat-huge": (message(chat_len, 2**62, "messages"), "max_tokens"),
        "chat-one-over": (message(chat_len, MAX_MODEL_LEN - chat_len + 1, "messages"),
                          "max_tokens"),
        "chat-completion-tokens": (message(chat_len, 2**62, "messages"),
                                   "max_completion_tokens"),
        "chat-both": (message(chat_len, MAX_MODEL_LEN, "messages"), "max_completion_tokens"),
    }
    for name, (text, param) in expected.items():
        response = got[name]
        assert response.status_code == 400, (name, response.text)
        assert response.headers["content-type"].startswith("application/json"), name
        assert response.json() == {"error": {"message": text, "type": "BadRequestError",
                                             "param": param, "code": 400}}, name
    assert got["nothing-pending"]
    for name in ("exact", "chat-exact", "chat-left-out", "left-out", "echo-full", "after"):
        assert got[name].status_code == 200, (name, got[name].text)
    usage = {name: got[name].json()["usage"]["completion_tokens"]
             for name in ("exact", "chat-exact", "chat-left-out", "left-out", "after")}
    assert usage == {"exact": room, "chat-exact": MAX_MODEL_LEN - chat_len,
                     "chat-left-out": MAX_MODEL_LEN - chat_len, "left-out": 4, "after": 3}
    for name in ("exact", "chat-exact", "chat-left-out", "left-out"):
        assert got[name].json()["choices"][0]["finish_reason"] == "length", name
    assert got["echo-full"].json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN
