"""gpt-oss's harmony through the OpenAI API with the openai SDK, on a tiny model whose chat
template writes harmony (so the server reads harmony without being told): the analysis channel
as `reasoning_content`, a call to `functions.NAME` as a tool call, the final channel and
preambles as `content`, streamed (the SDK's helper accumulates the same message) and not;
`reasoning_effort` and earlier calls rendered by the template; what harmony cannot do refused by
name. The random model is made to write each turn by a grammar, so the reading runs on real
engine output."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.serving.api_server import ServerSettings
from tests.utils.harmony_template import ANSWER, HARMONY_TEMPLATE, TURN
from tests.utils.inprocess_server import run_with_sdk
from tests.utils.server_helpers import copy_with_chat_template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}}}}
MESSAGES = [{"role": "user", "content": "Weather in Rome?"}]
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def harmony_model(tiny_model, tmp_path_factory) -> str:
    model = tiny_model("llama", max_position_embeddings=MAX_MODEL_LEN, eos_token_id=0)
    return copy_with_chat_template(model, tmp_path_factory.mktemp("harmony") / "tiny-harmony",
                                   HARMONY_TEMPLATE)


def _forced(text: str) -> dict[str, Any]:
    return {"structured_outputs": {"grammar": f"root ::= {json.dumps(text)}"}}


def _run(model_dir: str, calls, **settings: Any):
    return run_with_sdk(model_dir, calls, ServerSettings(served_model_name="tiny", **settings),
                        max_model_len=MAX_MODEL_LEN, num_kv_blocks=128)


def _prompt_tokens(model_dir: str, messages, tools=None, **kwargs: Any) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return len(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                             tokenize=True, return_dict=False, **kwargs))


async def _whole(sdk, _):
    return await sdk.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER],
                                             max_tokens=300, extra_body=_forced(TURN))


async def _streamed(sdk, _):
    chunks = []
    async with sdk.chat.completions.stream(
            model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=300,
            extra_body=_forced(TURN)) as stream:
        async for event in stream:
            if event.type == "chunk":
                chunks.append(event.chunk)
        return chunks, await stream.get_final_completion()


async def _answer(sdk, _):
    return await sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=300,
                                             extra_body=_forced(ANSWER))


async def _hidden(sdk, _):
    return await sdk.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=300,
        extra_body={**_forced(ANSWER), "include_reasoning": False})


HISTORY = [*MESSAGES,
           {"role": "assistant", "content": None, "tool_calls": [{
               "id": "call-1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
           {"role": "tool", "tool_call_id": "call-1", "content": "24 C, sunny"}]


def _prompt_tokens_served(messages, **extra: Any):
    async def call(sdk, _):
        done = await sdk.chat.completions.create(model="tiny", messages=messages,
                                                 tools=[WEATHER], max_tokens=1, **extra)
        return done.usage.prompt_tokens
    return call


async def _required(_, http):
    return await http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required"})


@pytest.fixture(scope="module")
def served(harmony_model) -> dict[str, Any]:
    """Every call of this module's harmony tests, on one server."""
    calls = {"whole": _whole, "streamed": _streamed, "answer": _answer, "hidden": _hidden,
             "high": _prompt_tokens_served(MESSAGES, reasoning_effort="high"),
             "low": _prompt_tokens_served(MESSAGES, reasoning_effort="low"),
             "earlier": _prompt_tokens_served(HISTORY), "required": _required}
    return dict(zip(calls, _run(harmony_model, list(calls.values()))))


def test_channels_become_reasoning_calls_and_content_whole_and_streamed(served):
    full, (chunks, accumulated) = served["whole"], served["streamed"]
    answered, without = served["answer"], served["hidden"]
    (choice,) = full.choices
    message = choice.message.model_dump()
    assert choice.finish_reason == "tool_calls"
    assert message["reasoning_content"] == "The user wants the weather in Rome."
    assert message["content"] == "Let me look that up."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert json.loads(call.function.arguments) == {"city": "Rome", "unit": "C"}
    # Streamed: the same parts, no markup in any delta, the thinking before the rest.
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == \
        message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert not any("<|" in (d.get("content") or "") + (d.get("reasoning_content") or "")
                   for d in deltas)
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert any(d.get("reasoning_content") for d in deltas[:first_content])
    (streamed_call,) = accumulated.choices[0].message.tool_calls
    assert (streamed_call.function.name, json.loads(streamed_call.function.arguments)) == (
        "get_weather", {"city": "Rome", "unit": "C"})
    assert accumulated.choices[0].finish_reason == "tool_calls"
    # The arguments came in more than one delta (the call streams as it is written).
    argument_deltas = [t for d in deltas for t in d.get("tool_calls") or []
                       if (t.get("function") or {}).get("arguments")]
    assert len(argument_deltas) > 1
    # The final channel is the content; no tools asked, no call.
    answer_message = answered.choices[0].message.model_dump()
    assert answer_message["content"] == "Sunny, 24 C in Rome."
    assert answer_message["reasoning_content"] == "It is sunny."
    assert answered.choices[0].finish_reason == "stop" and not answer_message["tool_calls"]
    hidden_message = without.choices[0].message.model_dump()
    assert hidden_message["content"] == "Sunny, 24 C in Rome."
    assert not hidden_message.get("reasoning_content")


def test_the_template_renders_effort_and_history_and_what_harmony_cannot_do_is_refused(
        served, harmony_model):
    high, low, earlier, refused = (served[k] for k in ("high", "low", "earlier", "required"))
    assert high == _prompt_tokens(harmony_model, MESSAGES, [WEATHER], reasoning_effort="high")
    assert low == _prompt_tokens(harmony_model, MESSAGES, [WEATHER], reasoning_effort="low")
    # The server hands the template an earlier call's arguments as an object (as vLLM does).
    as_objects = [{**m, "tool_calls": [{**c, "function": {
        **c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in HISTORY]
    assert earlier == _prompt_tokens(harmony_model, as_objects, [WEATHER])
    # Probe: the effort and the history did change the prompts.
    assert high != _prompt_tokens(harmony_model, MESSAGES, [WEATHER], reasoning_effort="a")
    assert earlier > _prompt_tokens(harmony_model, MESSAGES, [WEATHER])
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "tool_choice" and "harmony" in error["message"]


def test_reasoning_effort_is_refused_where_the_template_does_not_read_it(tiny_model,
                                                                         tmp_path_factory):
    model = copy_with_chat_template(
        tiny_model("llama", max_position_embeddings=MAX_MODEL_LEN, eos_token_id=0),
        tmp_path_factory.mktemp("plain") / "tiny-plain",
        "{% for m in messages %}{{ m.content }}\n{% endfor %}")

    async def effort(_, http):
        return await http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": MESSAGES, "reasoning_effort": "high",
            "max_tokens": 1})

    async def plain(_, http):
        return await http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": MESSAGES, "max_tokens": 1})

    refused, served = _run(model, [effort, plain])
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "reasoning_effort"
    assert served.status_code == 200
