"""Tool calling over HTTP with the openai SDK, on a tiny model whose chat template renders tools
in the hermes format (so `auto` picks the hermes parser from it): `required` and a named
function constrained to the tools' schemas, `auto` reading the model's own text (which a
grammar makes the random model write, so the parser's path runs end to end), streamed deltas
the SDK's stream helper accumulates, earlier calls and tool results in the history, and every
bad ask a 400 naming what is wrong; text that only looks like a call stays plain content."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.serving.api_server import ServerSettings
from tests.utils.inprocess_server import run_with_sdk
from tests.utils.server_helpers import copy_with_chat_template

TEMPLATE = (
    "{%- if tools %}<|system|>Tools: {{ tools | tojson }}. Call one as <tool_call>"
    "{\"name\": ..., \"arguments\": ...}</tool_call>\n{% endif %}"
    "{%- for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{%- endfor %}{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}\n{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
        "city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "required": ["zone"],
                                       "properties": {"zone": {"enum": ["CET", "UTC"]}}}}}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def tool_model(tiny_model, tmp_path_factory) -> str:
    model = tiny_model("llama", max_position_embeddings=MAX_MODEL_LEN, eos_token_id=0)
    return copy_with_chat_template(model, tmp_path_factory.mktemp("tools") / "tiny-tools",
                                   TEMPLATE)


def _run(model_dir: str, calls, **settings: Any):
    return run_with_sdk(model_dir, calls, ServerSettings(served_model_name="tiny", **settings),
                        max_model_len=MAX_MODEL_LEN, num_kv_blocks=128)


def _check_weather_or_time(call) -> None:
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert arguments["city"] in ("Paris", "Rome") and arguments["unit"] in ("C", "F")
    else:
        assert call.function.name == "get_time" and arguments["zone"] in ("CET", "UTC")


def test_required_and_named_tool_choice_return_calls_that_match_the_schemas(tool_model):
    async def required(sdk, _):
        return await sdk.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                 tool_choice="required", max_tokens=300,
                                                 temperature=0)

    async def required_one(sdk, _):
        return await sdk.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                 tool_choice="required", max_tokens=300,
                                                 temperature=1.0, seed=3, n=3,
                                                 parallel_tool_calls=False)

    async def named(sdk, _):
        return await sdk.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_time"}})

    async def none(sdk, _):
        return await sdk.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                 tool_choice="none", max_tokens=20,
                                                 temperature=0)

    forced, single, by_name, plain = _run(tool_model, [required, required_one, named, none])
    (choice,) = forced.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        _check_weather_or_time(call)
    assert all(len(c.message.tool_calls) == 1 for c in single.choices)
    (named_call,) = by_name.choices[0].message.tool_calls
    assert named_call.function.name == "get_time" and by_name.choices[0].finish_reason == "stop"
    _check_weather_or_time(named_call)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


# What the random model is made to write with tool_choice auto (a grammar holds it to the
# text): the hermes parser must find the call in it.
HERMES_CALL = ('Checking. <tool_call>{"name": "get_weather", "arguments": '
               '{"city": "Rome", "unit": "C"}}</tool_call>')
NOT_A_CALL = '<tool_call>{"name": oops}</tool_call>'


def _forced(text: str) -> dict[str, Any]:
    return {"structured_outputs": {"grammar": f"root ::= {json.dumps(text)}"}}


def test_auto_reads_the_models_own_calls_streamed_and_whole(tool_model):
    async def whole(sdk, _):
        return await sdk.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                 max_tokens=200, extra_body=_forced(HERMES_CALL))

    async def streamed(sdk, _):
        chunks = []
        async with sdk.chat.completions.stream(
                model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                extra_body=_forced(HERMES_CALL)) as stream:
            async for event in stream:
                if event.type == "chunk":
                    chunks.append(event.chunk)
            return chunks, await stream.get_final_completion()

    async def malformed(sdk, _):
        return await sdk.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                 max_tokens=200, extra_body=_forced(NOT_A_CALL))

    async def unconstrained(sdk, _):
        return await sdk.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                 max_tokens=30, temperature=0)

    full, (chunks, accumulated), broken, free = _run(
        tool_model, [whole, streamed, malformed, unconstrained])
    (choice,) = full.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking. "
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Rome", "unit": "C"}
    # Streamed: no chunk's content carries any of the call's markup; the call comes as deltas
    # of one index, its id and name once the name is written, then its arguments in fragments
    # as they are written; the SDK's helper accumulates the same message.
    contents = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert contents == "Checking. "
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    (streamed_call,) = accumulated.choices[0].message.tool_calls
    header, *fragments = deltas
    assert [d.index for d in deltas] == [0] * len(deltas)
    assert header.id == streamed_call.id and header.function.name == "get_weather"
    assert header.function.arguments == "" and all(f.id is None for f in fragments)
    assert len(fragments) > 2  # probe: the arguments came in pieces, not whole at the end
    assert "".join(f.function.arguments for f in fragments) == call.function.arguments
    assert streamed_call.function.name == "get_weather"
    assert streamed_call.function.arguments == call.function.arguments
    assert accumulated.choices[0].finish_reason == "tool_calls"
    # Text that only looks like a call is plain content, never an error.
    assert broken.choices[0].message.content == NOT_A_CALL
    assert broken.choices[0].message.tool_calls is None
    assert broken.choices[0].finish_reason == "stop"
    # Probe: unconstrained, the random model writes no call and gets plain content.
    assert free.choices[0].message.tool_calls is None


def test_earlier_calls_and_tool_results_reach_the_template(tool_model):
    history = [*MESSAGES,
               {"role": "assistant", "content": "", "tool_calls": [{
                   "id": "call-1", "type": "function",
                   "function": {"name": "get_weather",
                                "arguments": '{"city": "Paris", "unit": "C"}'}}]},
               {"role": "tool", "tool_call_id": "call-1", "content": "21 degrees"}]

    async def rendered(_, http):
        return await http.post("/tokenize", json={"messages": history, "model": "tiny"})

    async def answered(sdk, _):
        return await sdk.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                                 tool_choice="none", max_tokens=5)

    async def bad_arguments(_, http):
        broken = [*history[:1], {**history[1], "tool_calls": [{
            "id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
        return await http.post("/v1/chat/completions", json={"model": "tiny",
                                                              "messages": broken})

    tokens, answer, bad = _run(tool_model, [rendered, answered, bad_arguments])
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(tool_model).decode(tokens.json()["tokens"])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}' \
           '</tool_call>' in text
    assert "21 degrees (call-1)" in text
    assert answer.choices[0].message.content is not None
    assert bad.status_code == 400 and "function.arguments is not JSON" in \
        bad.json()["error"]["message"]


BAD = [
    ({"tool_choice": "required"}, "tool_choice 'required' needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "names function 'nope', which tools does not define"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice required and a structured output"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
      "tool_choice": "required"}, 'Unsupported type "nonsense"'),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
]


def test_bad_tool_asks_are_400s_naming_what_is_wrong(tool_model):
    calls = [lambda _, http, extra=extra: http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 5, **extra}) for extra, _ in BAD]
    for (extra, reason), response in zip(BAD, _run(tool_model, calls)):
        assert response.status_code == 400, (extra, response.text)
        message = response.json()["error"]["message"]
        assert reason in message, (extra, message)
        assert "Traceback" not in message


def test_auto_without_a_parser_is_a_400_naming_the_option(tiny_model, tmp_path):
    folder = copy_with_chat_template(
        tiny_model("llama", max_position_embeddings=MAX_MODEL_LEN), tmp_path / "no-tool-format",
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if tools %}{{ tools | tojson }}{% endif %}")
    request = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, "tools": TOOLS}
    (refused,) = _run(folder, [lambda _, http: http.post("/v1/chat/completions",
                                                               json=request)])
    assert refused.status_code == 400
    assert "--tool-call-parser" in refused.json()["error"]["message"]
    # Given the option, the same request is served.
    (served,) = _run(folder, [lambda _, http: http.post("/v1/chat/completions",
                                                              json=request)],
                     tool_call_parser="hermes")
    assert served.status_code == 200, served.text


def test_a_tool_calls_name_held_back_until_written_is_the_first_output_the_scheduler_hears_of(
        tool_model):
    """The hermes parser holds a call back until its name is written (the
    stream then sends its id and name, then its arguments as they settle), so the client's
    first visible output is the call's name, not the engine's first token. The note that
    tells the scheduler a request's first output was delivered (FirstOutputDelivered: its TTFT
    objective met or missed for good) is sent when that chunk is written, not before; the
    assistant role's empty opening chunk does not count."""
    import asyncio

    from transformers import AutoTokenizer

    from engine.ipc.core_messages import CoreOutputs
    from engine.outputs import EngineCoreOutput, SchedulerStats
    from tests.utils.inprocess_server import FakeCore, app_client

    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    text = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [ids[len(ids) * k // 4:len(ids) * (k + 1) // 4] for k in range(4)]
    # The piece whose tokens finish writing the name: its chunk is the first output.
    named_in = next(k for k in range(4) if '"get_time"' in tokenizer.decode(
        [t for piece in pieces[:k + 1] for t in piece]))
    assert named_in < 3, "the name must come before the call's last piece"
    gap_s = 0.15

    def call_over_time(message):
        frames: list = []
        for k, piece in enumerate(pieces):
            out = EngineCoreOutput(req_id=message.request_id, new_token_ids=piece,
                                   finish_reason="stop" if k == len(pieces) - 1 else None)
            frames += [CoreOutputs(outputs=[out], stats=SchedulerStats()), gap_s]
        return frames[:-1], False

    fake = FakeCore(len(tokenizer), script=call_over_time, max_model_len=MAX_MODEL_LEN)

    async def run():
        settings = ServerSettings(served_model_name="tiny", tool_call_parser="hermes")
        async with app_client(tool_model, settings, fake=fake,
                              max_model_len=MAX_MODEL_LEN) as (http, _):
            body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "stream": True,
                    "max_tokens": 100, "ttft_slo_ms": 5000}
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                chunks = [line async for line in response.aiter_lines()
                          if line.startswith("data: {")]
            for _ in range(100):  # the note travels to the core on its own
                if fake.delivered:
                    break
                await asyncio.sleep(0.01)
            return [json.loads(line[6:]) for line in chunks]

    chunks = asyncio.run(run())
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"] for d in deltas if d.get("tool_calls")]
    assert calls and calls[0][0]["function"]["name"] == "get_time", chunks
    assert calls[0][0]["function"]["arguments"] == ""
    assert "".join(c[0]["function"]["arguments"] for c in calls[1:]) == '{"zone": "UTC"}'
    assert not any(d.get("content") for d in deltas)  # nothing of the call leaked as text
    (delivered,) = fake.delivered
    first_token_sent, last_token_sent = fake.sent_at[0], fake.sent_at[-1]
    # Probe: the engine's tokens really came over 3 gaps, the first long before the last.
    assert last_token_sent - first_token_sent >= 3 * gap_s * 0.9
    # Delivered with the piece that wrote the name: not before, and not held to the end.
    assert fake.sent_at[named_in] <= delivered.delivered_at < last_token_sent


def test_a_named_call_streams_its_name_with_the_first_token_and_its_arguments_as_written(
        tool_model):
    """A named function's output is its arguments: the stream sends the call's id and name at
    once (the client's first visible output, so what its TTFT counts), then the arguments in
    fragments of the same index as they settle, which the SDK's helper appends; the
    accumulated message is the non-streamed one. Cut short by max_tokens, the call keeps the
    settled part of its arguments in both (vLLM returns them so)."""
    named = {"type": "function", "function": {"name": "get_weather"}}

    def create(max_tokens: int):
        async def call(sdk, _):
            return await sdk.chat.completions.create(
                model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=named,
                max_tokens=max_tokens, temperature=0)
        return call

    def streamed(max_tokens: int):
        async def call(sdk, _):
            chunks = []
            async with sdk.chat.completions.stream(
                    model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=named,
                    max_tokens=max_tokens, temperature=0) as stream:
                async for event in stream:
                    if event.type == "chunk":
                        chunks.append(event.chunk)
                return chunks, await stream.get_final_completion()
        return call

    async def short_streamed_arguments(sdk, _):
        # The SDK's helper refuses a completion cut short (LengthFinishReasonError): the raw
        # stream, its argument deltas appended as the helper would.
        stream = await sdk.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=3,
            temperature=0, stream=True)
        arguments = ""
        async for chunk in stream:
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                arguments += delta.function.arguments or ""
        return arguments

    whole, (chunks, accumulated), short, short_streamed = _run(
        tool_model, [create(200), streamed(200), create(3), short_streamed_arguments])
    (call,) = whole.choices[0].message.tool_calls
    _check_weather_or_time(call)
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    header, *fragments = deltas
    assert [d.index for d in deltas] == [0] * len(deltas)
    (streamed_call,) = accumulated.choices[0].message.tool_calls
    assert header.id == streamed_call.id and header.function.name == "get_weather"
    assert header.function.arguments == "" and all(f.id is None for f in fragments)
    assert len(fragments) > 2  # probe: in pieces
    assert "".join(f.function.arguments for f in fragments) == call.function.arguments
    # The header went out in the first chunk after the role's, before any argument text.
    with_output = [c for c in chunks if c.choices and (c.choices[0].delta.tool_calls
                                                       or c.choices[0].delta.content)]
    assert with_output[0].choices[0].delta.tool_calls[0].function.name == "get_weather"
    assert streamed_call.function.arguments == call.function.arguments
    assert accumulated.choices[0].finish_reason == whole.choices[0].finish_reason == "stop"
    # Cut short: the partial arguments, a call all the same, streamed or not.
    (cut,) = short.choices[0].message.tool_calls
    assert short.choices[0].finish_reason == "length" and cut.function.name == "get_weather"
    assert cut.function.arguments and not cut.function.arguments.endswith("}")
    assert short_streamed == cut.function.arguments
