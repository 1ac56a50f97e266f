"""Structured outputs over HTTP, as clients ask for them: the openai SDK's
`chat.completions.parse(response_format=PydanticModel)` returns a parsed object, `json_object`
gives a JSON object, vLLM's `structured_outputs` and `guided_*` work on both routes and
streamed, and every malformed or conflicting ask is a 400 naming what is wrong, before any work
(the engine never sees it)."""

from __future__ import annotations

import json
import re
from typing import Literal

import pytest
from pydantic import BaseModel

from engine.serving.api_server import ServerSettings
from tests.utils.inprocess_server import run_with_sdk
from tests.utils.server_helpers import copy_with_chat_template

MAX_MODEL_LEN = 256


class Verdict(BaseModel):
    colour: Literal["red", "green", "blue"]
    ok: bool


@pytest.fixture(scope="module")
def chat_model(tiny_model, tmp_path_factory) -> str:
    # The tokenizer's EOS (special: not in the text), which the grammar ends the output with.
    model = tiny_model("llama", max_position_embeddings=MAX_MODEL_LEN, eos_token_id=0)
    return copy_with_chat_template(model, tmp_path_factory.mktemp("structured") / "tiny-chat")


def _run(model_dir: str, calls):
    return run_with_sdk(model_dir, calls, ServerSettings(served_model_name="tiny"),
                        max_model_len=MAX_MODEL_LEN), None


MESSAGES = [{"role": "user", "content": "Give me a verdict."}]


def test_the_openai_sdk_parses_a_pydantic_response_format(chat_model):
    async def parse(sdk, _):
        return await sdk.chat.completions.parse(model="tiny", messages=MESSAGES,
                                                response_format=Verdict, max_tokens=150,
                                                temperature=0)

    async def sampled(sdk, _):
        return await sdk.chat.completions.parse(model="tiny", messages=MESSAGES,
                                                response_format=Verdict, max_tokens=150,
                                                temperature=1.0, seed=5, n=3)

    async def free(sdk, _):
        return await sdk.chat.completions.create(model="tiny", messages=MESSAGES,
                                                 max_tokens=30, temperature=0)

    (greedy, several, unconstrained), _ = _run(chat_model, [parse, sampled, free])
    (choice,) = greedy.choices
    assert isinstance(choice.message.parsed, Verdict), choice.message.content
    assert choice.finish_reason == "stop"
    assert all(isinstance(c.message.parsed, Verdict) for c in several.choices)
    # Probe: unconstrained, the tiny random model writes no JSON at all.
    assert not unconstrained.choices[0].message.content.lstrip().startswith("{")


def test_json_object_and_vllms_fields_on_both_routes_and_streamed(chat_model):
    regex = r"[a-c]{2,4}-[0-9]{3}"

    async def json_object(sdk, _):
        return await sdk.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=200, temperature=0,
            response_format={"type": "json_object"})

    async def structured_regex(sdk, _):
        return await sdk.completions.create(model="tiny", prompt="code:", max_tokens=40,
                                            temperature=0,
                                            extra_body={"structured_outputs": {"regex": regex}})

    async def guided_choice_streamed(sdk, _):
        stream = await sdk.completions.create(model="tiny", prompt="pick:", max_tokens=20,
                                              temperature=0.7, seed=1, stream=True,
                                              extra_body={"guided_choice": ["yes", "no way"]})
        return "".join([chunk.choices[0].text async for chunk in stream
                        if chunk.choices])

    async def guided_json_chat_streamed(sdk, _):
        stream = await sdk.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=150, temperature=0, stream=True,
            extra_body={"guided_json": Verdict.model_json_schema()})
        return "".join([chunk.choices[0].delta.content or "" async for chunk in stream
                        if chunk.choices])

    async def grammar(sdk, _):
        return await sdk.completions.create(
            model="tiny", prompt="list:", max_tokens=60, temperature=0,
            extra_body={"structured_outputs": {"grammar": 'root ::= "[" [xyz]+ "]"'}})

    (obj, code, picked, streamed_json, listed), _ = _run(
        chat_model, [json_object, structured_regex, guided_choice_streamed,
                     guided_json_chat_streamed, grammar])
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    assert re.fullmatch(regex, code.choices[0].text), code.choices[0].text
    assert picked in ("yes", "no way")
    Verdict.model_validate_json(streamed_json)
    assert re.fullmatch(r"\[[xyz]+\]", listed.choices[0].text), listed.choices[0].text


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "v"}}},
     "json_schema needs json_schema.schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "v", "schema": {"type": "nonsense"}}}},
     'JSON schema is not valid: Unsupported type "nonsense"'),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regex": "[a-z"}}, "the regex is not valid"),
    ({"structured_outputs": {"grammar": "root ::= foo"}}, 'Rule "foo" is not defined'),
    ({"structured_outputs": {"json": {"type": "integer", "minimum": 5, "maximum": 3}}},
     "minimum greater than maximum"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
    ({"structured_outputs": {"regx": "a"}}, "unknown key 'regx'"),
    ({"structured_outputs": {"whitespace_pattern": " +"}},
     "structured_outputs.whitespace_pattern is not supported"),
    ({"structured_outputs": {"choice": []}}, "non-empty list"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "give one guided_"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}},
     "give one way to constrain"),
    ({"guided_json": {}, "guided_decoding_backend": "outlines"}, "only xgrammar"),
    ({"guided_choice": ["a"], "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
]


def test_malformed_or_conflicting_asks_are_400s_before_any_work(chat_model):
    calls = [lambda _, http, extra=extra: http.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 5,
                                      **extra}) for extra, _ in BAD]
    calls.append(lambda _, http: http.get("/metrics"))
    calls.append(lambda _, http: http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 5,
        "structured_outputs": {"choice": ["fine"]}}))
    calls.append(lambda _, http: http.get("/metrics"))
    (*responses, before, served, after), _ = _run(chat_model, calls)
    for (extra, reason), response in zip(BAD, responses):
        assert response.status_code == 400, (extra, response.text)
        message = response.json()["error"]["message"]
        assert re.search(reason, message) or reason in message, (extra, message)
        assert "Traceback" not in message and ".cc:" not in message
    # None of them reached the engine (a 400 before any work): no prompt was looked up in
    # its prefix cache, as the one good request's was.
    assert served.status_code == 200 and served.json()["choices"][0]["message"]["content"] \
        == "fine"
    assert _prompt_lookups(before.text) == 0 < _prompt_lookups(after.text)


def _prompt_lookups(metrics: str) -> float:
    found = re.findall(r"^sloserve:prefix_cache_queries_total(?:\{[^}]*\})? (\S+)$", metrics,
                       re.M)
    assert found, "no prefix_cache_queries counter"
    return sum(float(v) for v in found)


def test_the_engine_process_describes_the_vocabulary_before_it_reports_ready(chat_model, capfd):
    """A server's first agent turn must not pay for the vocabulary's description (2.3 s for
    Llama 3's 128k tokens on the H100 machine): the engine process builds it before it reports
    ready, so by the time the app serves its first request the engine has logged it."""
    seen_at_first_request: list[str] = []

    async def first_request(sdk, _):
        seen_at_first_request.append(capfd.readouterr().err)
        return await sdk.completions.create(model="tiny", prompt="a", max_tokens=2,
                                            temperature=0)

    (completion,), _ = _run(chat_model, [first_request])
    assert completion.choices[0].text is not None
    assert "structured outputs: the vocabulary's description" in seen_at_first_request[0]
