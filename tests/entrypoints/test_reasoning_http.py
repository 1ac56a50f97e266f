"""A reasoning model's thinking over HTTP (`--reasoning-parser qwen3`), on a tiny Qwen3
checkpoint with a thinking chat template: `reasoning_content` (and vLLM's `reasoning`) apart
from `content` in messages and stream deltas, `include_reasoning: false`, `chat_template_kwargs`
reaching the template (`enable_thinking: false`), earlier thinking in the history, and thinking
before a tool call. The random model is made to write a think block by a grammar, so the split
runs on real engine output."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.serving.api_server import ServerSettings
from tests.utils.inprocess_server import run_with_sdk
from tests.utils.server_helpers import copy_with_chat_template

TEMPLATE = (
    "{%- if tools %}<|system|>Tools: {{ tools | tojson }} as <tool_call>...</tool_call>\n"
    "{% endif %}"
    "{%- for m in messages %}<|{{ m['role'] }}|>"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m['content'] }}\n{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- endif %}{% endif %}")
THINKING = "<think>\nThe user wants a city.\n</think>\n\nParis."
MESSAGES = [{"role": "user", "content": "Capital of France?"}]
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def qwen3_model(tiny_model, tmp_path_factory) -> str:
    model = tiny_model("qwen3", max_position_embeddings=MAX_MODEL_LEN, eos_token_id=0)
    return copy_with_chat_template(model, tmp_path_factory.mktemp("reasoning") / "tiny-qwen3",
                                   TEMPLATE)


def _forced(text: str) -> dict[str, Any]:
    return {"structured_outputs": {"grammar": f"root ::= {json.dumps(text)}"}}


def _run(model_dir: str, calls, **settings: Any):
    return run_with_sdk(model_dir, calls, ServerSettings(served_model_name="tiny", **settings),
                        max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)


def test_thinking_is_split_from_the_answer_whole_and_streamed(qwen3_model):
    async def whole(sdk, _):
        return await sdk.chat.completions.create(model="tiny", messages=MESSAGES,
                                                 max_tokens=100, extra_body=_forced(THINKING))

    async def streamed(sdk, _):
        stream = await sdk.chat.completions.create(model="tiny", messages=MESSAGES,
                                                   max_tokens=100, stream=True,
                                                   extra_body=_forced(THINKING))
        return [chunk async for chunk in stream]

    async def hidden(sdk, _):
        return await sdk.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=100,
            extra_body={**_forced(THINKING), "include_reasoning": False})

    async def cut_short(sdk, _):
        return await sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=14,
                                                 extra_body=_forced(THINKING))

    full, chunks, without, cut = _run(qwen3_model, [whole, streamed, hidden, cut_short],
                                      reasoning_parser="qwen3")
    message = full.choices[0].message.model_dump()
    assert message["reasoning_content"] == message["reasoning"] == "\nThe user wants a city.\n"
    assert message["content"] == "\n\nParis."
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    thought = "".join(d.get("reasoning_content") or "" for d in deltas)
    answer = "".join(d.get("content") or "" for d in deltas)
    assert thought == message["reasoning_content"] and answer == message["content"]
    assert not any("think>" in (d.get("content") or "") + (d.get("reasoning_content") or "")
                   for d in deltas)
    # The thinking streamed before the answer, in more than one chunk.
    first_answer = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert sum(bool(d.get("reasoning_content")) for d in deltas[:first_answer]) > 1
    hidden_message = without.choices[0].message.model_dump()
    assert not hidden_message.get("reasoning_content")
    assert hidden_message["content"] == "\n\nParis."
    # Cut short while thinking: the thinking so far, no answer.
    cut_message = cut.choices[0].message.model_dump()
    assert cut.choices[0].finish_reason == "length" and cut_message["content"] is None
    assert cut_message["reasoning_content"]


def test_without_a_parser_the_think_block_is_content(qwen3_model):
    async def whole(sdk, _):
        return await sdk.chat.completions.create(model="tiny", messages=MESSAGES,
                                                 max_tokens=100, extra_body=_forced(THINKING))

    (full,) = _run(qwen3_model, [whole])
    assert full.choices[0].message.content == THINKING


def test_template_kwargs_and_earlier_thinking_reach_the_template(qwen3_model):
    def usage(extra: dict[str, Any], messages=MESSAGES):
        async def call(sdk, _):
            done = await sdk.chat.completions.create(model="tiny", messages=messages,
                                                     max_tokens=1, extra_body=extra)
            return done.usage.prompt_tokens
        return call

    history = [*MESSAGES, {"role": "assistant", "content": "Paris.",
                           "reasoning_content": "An easy one."},
               {"role": "user", "content": "And Italy?"}]
    plain_history = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in history]

    async def reserved(_, http):
        return await http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": MESSAGES, "chat_template_kwargs": {"tokenize": False}})

    thinking_on, thinking_off, with_thought, without_thought, refused = _run(qwen3_model, [
        usage({}), usage({"chat_template_kwargs": {"enable_thinking": False}}),
        usage({}, history), usage({}, plain_history), reserved], reasoning_parser="qwen3")
    assert thinking_off > thinking_on  # the template closed an empty think block
    assert with_thought > without_thought
    assert refused.status_code == 400
    assert "`tokenize` is not a template variable" in refused.json()["error"]["message"]


def test_thinking_then_a_tool_call(qwen3_model):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]
    text = ('<think>\nI should look it up.\n</think>\n\n<tool_call>{"name": "lookup", '
            '"arguments": {"q": "France"}}</tool_call>')

    async def call(sdk, _):
        return await sdk.chat.completions.create(model="tiny", messages=MESSAGES, tools=tools,
                                                 max_tokens=200, extra_body=_forced(text))

    (done,) = _run(qwen3_model, [call], reasoning_parser="qwen3", tool_call_parser="hermes")
    message = done.choices[0].message.model_dump()
    assert message["reasoning_content"] == "\nI should look it up.\n"
    assert message["content"] == "\n\n"
    (tool_call,) = message["tool_calls"]
    assert tool_call["function"]["name"] == "lookup"
    assert json.loads(tool_call["function"]["arguments"]) == {"q": "France"}
    assert done.choices[0].finish_reason == "tool_calls"


def _final_metrics(sse: str) -> dict[str, Any]:
    events = [json.loads(line[len("data: "):]) for line in sse.splitlines()
              if line.startswith("data: {")]
    return next(e["metrics"] for e in reversed(events) if e.get("metrics"))


def test_the_time_to_the_first_answer_token_is_a_metric(qwen3_model):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 100, **_forced(THINKING)}

    async def streamed(_, http):
        return (await http.post("/v1/chat/completions", json={**body, "stream": True})).text

    async def whole(_, http):
        return (await http.post("/v1/chat/completions", json=body)).json()["metrics"]

    async def prometheus(_, http):
        return (await http.get("/metrics")).text

    stream, full, exported = _run(qwen3_model, [streamed, whole, prometheus],
                                  reasoning_parser="qwen3")
    streamed_metrics = _final_metrics(stream)
    # The thinking's first token reached the client before the answer's first token.
    assert streamed_metrics["time_to_first_answer_ms"] > streamed_metrics["ttft_ms"] > 0
    assert full["time_to_first_answer_ms"] > full["ttft_ms"] > 0
    count = [line for line in exported.splitlines()
             if line.startswith("sloserve:time_to_first_answer_token_seconds_count")]
    assert count and float(count[0].split()[-1]) == 2
    # Without a reasoning parser, the answer is the output: the same stamp as the first token.
    (plain,) = _run(qwen3_model, [streamed])
    plain_metrics = _final_metrics(plain)
    assert plain_metrics["time_to_first_answer_ms"] == plain_metrics["ttft_ms"]
