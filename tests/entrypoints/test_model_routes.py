"""Model names as vLLM serves them (the --model argument as given, the folder's base name
accepted, several --served-model-name), /v1/models/{id}, and /tokenize / /detokenize in vLLM's
shapes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from engine.serving.api_server import ServerSettings
from tests.utils.inprocess_server import MAX_MODEL_LEN, app_client
from tests.utils.server_helpers import CHAT_TEMPLATE, ServerProcess, copy_with_chat_template


@pytest.fixture(scope="module")
def chat_model(tiny_model, tmp_path_factory):
    return copy_with_chat_template(tiny_model("llama", max_position_embeddings=MAX_MODEL_LEN),
                                   tmp_path_factory.mktemp("routes") / "tiny-chat")


def _run(model_dir: str, settings: ServerSettings, calls):
    async def go():
        async with app_client(model_dir, settings) as (http, _):
            return [await call(http) for call in calls]

    return asyncio.run(go())


def _settings(model_dir: str) -> ServerSettings:
    return ServerSettings(served_model_name="first", other_served_names=("second",),
                          model_root=model_dir)


def test_models_list_every_served_name_with_its_root_and_accept_the_folder_name(chat_model):
    completion = {"prompt": "hello", "max_tokens": 1}
    listing, second, by_folder, unknown, by_folder_request, unknown_request = _run(
        chat_model, _settings(chat_model), [
            lambda h: h.get("/v1/models"),
            lambda h: h.get("/v1/models/second"),
            lambda h: h.get("/v1/models/tiny-chat"),
            lambda h: h.get("/v1/models/nope"),
            lambda h: h.post("/v1/completions", json={**completion, "model": "tiny-chat"}),
            lambda h: h.post("/v1/completions", json={**completion, "model": "nope"}),
        ])
    cards = listing.json()["data"]
    assert [c["id"] for c in cards] == ["first", "second"]
    assert all(c["root"] == chat_model and c["max_model_len"] == MAX_MODEL_LEN for c in cards)
    assert second.status_code == 200 and second.json()["id"] == "second"
    assert by_folder.status_code == 200 and by_folder.json()["root"] == chat_model
    assert unknown.status_code == 404
    assert unknown.json()["error"]["param"] == "model"
    assert "`first`, `second`" in unknown.json()["error"]["message"]
    assert by_folder_request.status_code == 200
    assert by_folder_request.json()["model"] == "first"  # responses carry the first name
    assert unknown_request.status_code == 404


def test_tokenize_and_detokenize_round_trip_with_the_model_s_tokenizer(chat_model):
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    text = "The quick brown fox"
    messages = [{"role": "user", "content": "hi there"}]
    ids = tokenizer.encode(text, add_special_tokens=False)
    plain, bare, chat, chat_open, decoded = _run(chat_model, _settings(chat_model), [
        lambda h: h.post("/tokenize", json={"prompt": text, "return_token_strs": True}),
        lambda h: h.post("/tokenize", json={"prompt": text, "add_special_tokens": False}),
        lambda h: h.post("/tokenize", json={"messages": messages, "model": "tiny-chat"}),
        lambda h: h.post("/tokenize", json={"messages": messages,
                                            "add_generation_prompt": False}),
        lambda h: h.post("/detokenize", json={"tokens": ids}),
    ])
    body = plain.json()
    assert body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert bare.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert bare.json()["token_strs"] is None
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert chat.json()["tokens"] == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat_open.json()["tokens"] == tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, tokenize=True, return_dict=False)
    assert chat.json()["count"] > chat_open.json()["count"]  # probe: the flag really applied
    assert decoded.json() == {"prompt": text}


BAD_REQUESTS = [
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
    ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "add_special_tokens": True},
     "add_special_tokens"),
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
]


def test_bad_tokenize_requests_are_clear_errors(chat_model):
    calls = [lambda h, path=path, body=body: h.post(path, json=body)
             for path, body, _ in BAD_REQUESTS]
    responses = _run(chat_model, _settings(chat_model), calls)
    for (path, body, param), response in zip(BAD_REQUESTS, responses):
        assert response.status_code in (400, 404), (path, body, response.text)
        error = response.json()["error"]
        if param is not None:
            assert error["param"] == param, (path, body, error)
        assert "Traceback" not in error["message"]


def test_the_cli_serves_the_model_argument_as_given(chat_model, tmp_path):
    given = str(Path(chat_model).parent / ".." / Path(chat_model).parent.name / "tiny-chat")
    server = ServerProcess(given, tmp_path / "server.log", "--num-kv-blocks", "16",
                           "--max-model-len", str(MAX_MODEL_LEN))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        (card,) = client.models.list().data
        assert card.id == given  # as typed, not resolved: clients load the tokenizer from it
        assert card.root == str(Path(chat_model).resolve())
        done = client.completions.create(model="tiny-chat", prompt="hi", max_tokens=1)
        assert done.model == given
        assert httpx.post(f"{server.url}/tokenize", json={"prompt": "hi", "model": given}
                          ).json()["count"] > 0
    finally:
        server.assert_clean_stop()


def test_tokenize_routes_need_the_api_key_like_v1(chat_model):
    settings = ServerSettings(served_model_name="first", model_root=chat_model, api_key="k3y")
    key = {"Authorization": "Bearer k3y"}
    without, with_key, detok, model_card = _run(chat_model, settings, [
        lambda h: h.post("/tokenize", json={"prompt": "a"}),
        lambda h: h.post("/tokenize", json={"prompt": "a"}, headers=key),
        lambda h: h.post("/detokenize", json={"tokens": [1]}),
        lambda h: h.get("/v1/models/first"),
    ])
    assert without.status_code == 401 and with_key.status_code == 200
    assert detok.status_code == 401 and model_card.status_code == 401


# Refused on chat (completions implement echo, chat's top_logprobs is completions' logprobs).
CHAT_ONLY = {"echo"}
# A value asking for something, for every field request_fields.NOT_IMPLEMENTED names.
ASKS_FOR_MORE = {
    "echo": True, "top_logprobs": 2, "use_beam_search": True, "length_penalty": 0.5,
    "tools": [{"type": "function"}], "tool_choice": "auto", "functions": [{"name": "f"}],
    "function_call": "auto", "structural_tag": "{}",
    "reasoning_effort": "low", "include_reasoning": False, "chat_template": "{{ x }}",
    "chat_template_kwargs": {"enable_thinking": False}, "documents": [{"text": "x"}],
    "add_generation_prompt": False, "continue_final_message": True,
    "add_special_tokens": False, "mm_processor_kwargs": {"a": 1}, "prompt_embeds": "AAAA",
    "truncate_prompt_tokens": 5, "allowed_token_ids": [1], "bad_words": ["x"],
    "spaces_between_special_tokens": False, "logits_processors": ["m.f"],
    "vllm_xargs": {"a": 1}, "return_token_ids": True, "request_id": "abc",
    "cache_salt": "s", "kv_transfer_params": {"a": 1}, "modalities": ["text", "audio"],
    "audio": {"voice": "x"}, "prediction": {"type": "content", "content": "x"},
    "web_search_options": {}, "verbosity": "low", "store": True, "service_tier": "flex",
}
# Values that ask for nothing (a client's or vLLM's defaults), and fields without effect.
ASKS_FOR_NOTHING = {"logprobs": None, "echo": False, "best_of": 1, "suffix": "",
                    "top_logprobs": 0,
                    "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
                    "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
                    "length_penalty": 1, "structured_outputs": None,
                    "include_reasoning": True, "chat_template_kwargs": {}, "documents": [],
                    "add_generation_prompt": True, "continue_final_message": False,
                    "bad_words": [], "spaces_between_special_tokens": True,
                    "return_token_ids": False, "vllm_xargs": {}, "modalities": ["text"],
                    "store": False, "service_tier": "auto",
                    "user": "someone", "metadata": {"k": "v"}, "parallel_tool_calls": False,
                    "some_field_no_server_defines": 1}


def test_fields_asking_for_what_the_server_lacks_are_400s_naming_them(chat_model):
    from engine.serving.request_fields import NOT_IMPLEMENTED

    assert set(ASKS_FOR_MORE) == set(NOT_IMPLEMENTED)  # every refused field is tried
    base = {"prompt": "hello", "max_tokens": 1}
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
    calls = [lambda h, f=field, v=value: h.post("/v1/chat/completions", json={**chat, f: v})
             if f in CHAT_ONLY else h.post("/v1/completions", json={**base, f: v})
             for field, value in ASKS_FOR_MORE.items()]
    calls.append(lambda h: h.post("/v1/completions", json={**base, "suffix": "end"}))
    # add_special_tokens asks for something on chat when true (the template writes them).
    calls.append(lambda h: h.post("/v1/chat/completions",
                                  json={**chat, "add_special_tokens": True}))
    calls.append(lambda h: h.post("/v1/completions",
                                  json={**base, **ASKS_FOR_NOTHING, "add_special_tokens": True}))
    calls.append(lambda h: h.post("/v1/chat/completions",
                                  json={**chat, **ASKS_FOR_NOTHING, "logprobs": False,
                                        "top_logprobs": None, "add_special_tokens": False}))
    *refused, suffix, chat_special, plain, plain_chat = _run(chat_model, _settings(chat_model),
                                                             calls)
    for field, response in zip([*ASKS_FOR_MORE, "suffix", "add_special_tokens"],
                               [*refused, suffix, chat_special]):
        assert response.status_code == 400, (field, response.text)
        error = response.json()["error"]
        assert error["param"] == field and "not supported" in error["message"], error
        assert f"`{field}`" in error["message"], error
    # Probe: the values that ask for nothing still get their completion.
    assert plain.status_code == 200, plain.text
    assert plain_chat.status_code == 200, plain_chat.text


def test_message_keys_the_template_would_lose_are_400s_and_a_name_reaches_it(tmp_path,
                                                                             chat_model):
    from engine.serving.request_fields import MESSAGE_NOT_IMPLEMENTED

    template = tmp_path / "named.jinja"
    template.write_text("{% for m in messages %}{{ m.get('name', 'nobody') }}: "
                        "{{ m['content'] }}\n{% endfor %}")
    # (A message's tool_calls, tool_call_id and reasoning_content reach the template:
    # test_tool_calling_http.py, test_reasoning_http.py.)
    lost = {"function_call": {"name": "f", "arguments": "{}"}}
    assert set(lost) == set(MESSAGE_NOT_IMPLEMENTED)

    def chat(message):
        return lambda h: h.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}, message], "max_tokens": 1})

    def count(message):
        return lambda h: h.post("/tokenize", json={"messages": [message]})

    async def go():
        async with app_client(chat_model, chat_template=str(template)) as (http, _):
            calls = [*(chat({"role": "assistant", "content": "", key: value})
                       for key, value in lost.items()),
                     count({"role": "user", "content": "hi", "name": "bob"}),
                     count({"role": "user", "content": "hi"}),
                     chat({"role": "user", "content": "hi", "name": "bob", "tool_calls": []})]
            return [await call(http) for call in calls]

    *refused, named, unnamed, named_chat = asyncio.run(go())
    for key, response in zip(lost, refused):
        assert response.status_code == 400, (key, response.text)
        error = response.json()["error"]
        assert error["param"] == "messages" and f"`{key}`" in error["message"], error
    # Probe: the name is rendered (the template writes "nobody" without it).
    assert named.status_code == unnamed.status_code == 200
    assert named.json()["count"] != unnamed.json()["count"]
    assert named_chat.status_code == 200, named_chat.text
