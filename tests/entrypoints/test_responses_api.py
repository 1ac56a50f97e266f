"""`POST /v1/responses` through the openai SDK on the default model (one server for the module):
text and item input with instructions, the same greedy text as the chat route, a stream whose
events come in the order the SDK's helper reads and whose deltas add up to the final text, a
forced function call and its round trip (the call and its output sent back as items), JSON for
a `text.format` schema, the TTFT objective from the header and the body, and bad input as a 400
naming the field while a stream beside it finishes untouched. The translation of items into
chat messages and of chat chunks into events (reasoning included, which the default model does
not write) is checked without a server below."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel

from engine.serving.api_server import ServerSettings
from engine.serving.responses_api import ResponsesShape
from engine.serving.responses_protocol import (RequestError, ResponsesRequest,
                                               as_responses_error, chat_request,
                                               messages_from_input, refused_field)
from tests.utils.inprocess_server import run_with_sdk
from workers.layers.cpu_bf16_weights import BF16_ENV
from workers.layers.cpu_prepack import PREPACK_ENV

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                          "properties": {"city": {"enum": ["Paris", "Rome"]}}}}
FORCED = {"type": "function", "name": "get_weather"}
QUESTION = "What is the capital of France?"
CITY = {"type": "object", "required": ["city"], "additionalProperties": False,
        "properties": {"city": {"enum": ["Paris", "Rome", "Madrid"]}}}
STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added", "response.output_text.delta",
                "response.output_text.done", "response.content_part.done",
                "response.output_item.done", "response.completed"]
BAD_BODIES = {
    "input": {"input": [{"type": "banana"}]},
    "input.content": {"input": [{"role": "user", "content": 5}]},
    "input.kind": {"input": 5},
    "tools": {"input": "hi", "tools": [{"type": "web_search"}]},
    "previous_response_id": {"input": "hi", "previous_response_id": "resp_123"},
    "store": {"input": "hi", "store": True},
    "max_output_tokens": {"input": "hi", "max_output_tokens": 0},
    "text.format": {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
}


async def _plain(sdk, _):
    return await sdk.responses.create(model=MODEL, input=QUESTION, max_output_tokens=6,
                                      temperature=0)


async def _chat_twin(sdk, _):
    return await sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=6,
        temperature=0)


async def _items(sdk, _):
    return await sdk.responses.create(
        model=MODEL, instructions="Answer in one word.", max_output_tokens=1, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Capital of Italy?"}]}])


async def _items_twin(sdk, _):
    return await sdk.chat.completions.create(model=MODEL, max_tokens=1, temperature=0, messages=[
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of Italy?"}])


async def _streamed(sdk, _):
    async with sdk.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=6,
                                    temperature=0) as stream:
        events = [event async for event in stream]
        return events, await stream.get_final_response()


async def _call(sdk, _):
    return await sdk.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                      tool_choice=FORCED, max_output_tokens=20)


async def _call_streamed(sdk, _):
    stream = await sdk.responses.create(model=MODEL, input="Weather in Rome?", tools=[WEATHER],
                                        tool_choice=FORCED, max_output_tokens=20, stream=True)
    return [event async for event in stream]


HISTORY_CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city": "Paris"}'}
HISTORY = [{"role": "user", "content": "Weather in Paris?"}, HISTORY_CALL,
           {"type": "function_call_output", "call_id": "call_1", "output": "24 C, sunny"}]


async def _round_trip(sdk, _):
    return await sdk.responses.create(model=MODEL, input=HISTORY, tools=[WEATHER],
                                      tool_choice="none", max_output_tokens=2)


async def _round_trip_twin(sdk, _):
    return await sdk.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "24 C, sunny"}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                 if k != "type"}}], tool_choice="none")


class City(BaseModel):
    city: Literal["Paris", "Rome", "Madrid"]


async def _schema(sdk, _):
    # What the SDK's `parse` sends: text.format json_schema, strict, from the model.
    return await sdk.responses.parse(model=MODEL, input="Name a capital city, as JSON.",
                                     max_output_tokens=30, text_format=City)


async def _slo(_, http):
    header = http.post("/v1/responses", headers={"X-SLO-TTFT-MS": "60000"},
                       json={"model": MODEL, "input": "Hi", "max_output_tokens": 2})
    body = http.post("/v1/responses", headers={"X-SLO-TTFT-MS": "60000"},
                     json={"model": MODEL, "input": "Hi", "max_output_tokens": 2,
                           "ttft_slo_ms": 90000, "stream": True})
    header, body = await asyncio.gather(header, body)
    return header.json(), body.text


async def _bad_beside_a_stream(sdk, http):
    async def good():
        stream = await sdk.responses.create(model=MODEL, input="Count to three.",
                                            max_output_tokens=6, stream=True)
        return [event async for event in stream]

    async def bad(body: dict[str, Any]):
        response = await http.post("/v1/responses", json={"model": MODEL, **body})
        return response.status_code, response.json()

    async def through_sdk():
        try:
            await sdk.responses.create(model=MODEL, input=[{"type": "banana"}])
        except openai.BadRequestError as exc:
            return exc.body
        return None

    return await asyncio.gather(good(), through_sdk(), *(bad(b) for b in BAD_BODIES.values()))


# Run side by side once the greedy pair above has run alone (batched with others, a float
# rounding could flip a greedy token): the engine batches them, so the module takes the time of
# the longest, not of all of them.
TOGETHER = {"items": _items, "items_twin": _items_twin, "streamed": _streamed, "call": _call,
            "call_streamed": _call_streamed, "round_trip": _round_trip,
            "round_trip_twin": _round_trip_twin, "schema": _schema, "slo": _slo,
            "bad": _bad_beside_a_stream}


async def _together(sdk, http):
    results = await asyncio.gather(*(call(sdk, http) for call in TOGETHER.values()))
    return dict(zip(TOGETHER, results))


@pytest.fixture(scope="module")
def served() -> dict[str, Any]:
    """Every call of this module, on one server with the default model."""
    from engine.entrypoints.default_model import default_model_path

    # The engine's start-up measurements of which CPU kernels suit the default model's weights
    # (half a minute on a busy machine) are skipped: this module checks the API, not speed.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(PREPACK_ENV, "0")
        patch.setenv(BF16_ENV, "0")
        plain, twin, together = run_with_sdk(
            str(default_model_path()), [_plain, _chat_twin, _together],
            ServerSettings(served_model_name=MODEL), max_model_len=1024, num_kv_blocks=128)
    return {"plain": plain, "chat_twin": twin, **together}


@pytest.mark.slow
def test_text_and_items_are_served_as_the_chat_route_serves_them(served):
    plain, twin = served["plain"], served["chat_twin"]
    assert plain.id.startswith("resp_") and plain.object == "response"
    assert plain.model == MODEL and plain.status == "incomplete"  # cut by max_output_tokens
    assert plain.incomplete_details.reason == "max_output_tokens"
    (message,) = plain.output
    assert message.type == "message" and message.role == "assistant"
    assert [part.type for part in message.content] == ["output_text"]
    # Greedy: the chat route's text for the same prompt.
    assert plain.output_text == twin.choices[0].message.content and plain.output_text
    assert plain.usage.input_tokens == twin.usage.prompt_tokens
    assert plain.usage.output_tokens == 6
    assert plain.usage.total_tokens == plain.usage.input_tokens + 6
    assert plain.model_extra["metrics"]["ttft_ms"] > 0
    # Instructions and input_text parts: the chat prompt of a system and a user message.
    items, items_twin = served["items"], served["items_twin"]
    assert items.usage.input_tokens == items_twin.usage.prompt_tokens
    assert items.output_text and items.usage.output_tokens == 1


@pytest.mark.slow
def test_a_stream_sends_the_events_the_sdk_reads_and_its_deltas_add_up(served):
    events, final = served["streamed"]
    kinds = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert collapsed == STREAM_ORDER
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(deltas) == final.output_text and final.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == final.output_text
    assert final.usage.output_tokens == 6 and final.status == "incomplete"
    item_ids = {getattr(e, "item_id", None) for e in events} - {None}
    assert item_ids == {final.output[0].id}


@pytest.mark.slow
def test_a_forced_function_call_and_its_round_trip(served):
    (call,) = served["call"].output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"} or json.loads(call.arguments) == {
        "city": "Rome"}
    assert served["call"].status == "completed"
    events = served["call_streamed"]
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (streamed_call,) = events[-1].response.output
    assert "".join(fragments) == streamed_call.arguments
    assert json.loads(streamed_call.arguments)["city"] in ("Paris", "Rome")
    assert events[2].item.call_id == streamed_call.call_id
    # The call and its output sent back as items: the chat prompt with the assistant's call
    # and the tool's message, answered with text.
    answer = served["round_trip"]
    assert answer.usage.input_tokens == served["round_trip_twin"].usage.prompt_tokens
    assert [item.type for item in answer.output] == ["message"]


@pytest.mark.slow
def test_a_text_format_schema_gives_json_that_matches_it(served):
    schema = served["schema"]
    assert json.loads(schema.output_text)["city"] in ("Paris", "Rome", "Madrid")
    assert schema.output_parsed.city in ("Paris", "Rome", "Madrid")
    assert schema.text.format.type == "json_schema" and schema.status == "completed"


@pytest.mark.slow
def test_the_ttft_objective_comes_from_the_header_and_the_body_wins(served):
    by_header, streamed = served["slo"]
    assert by_header["metrics"]["ttft_slo_ms"] == 60000 and by_header["metrics"]["ttft_slo_met"]
    completed = [json.loads(line[len("data: "):]) for line in streamed.splitlines()
                 if line.startswith("data: ") and "response.completed" in line]
    (event,) = completed
    assert event["response"]["metrics"]["ttft_slo_ms"] == 90000
    assert event["response"]["metrics"]["ttft_slo_met"]


@pytest.mark.slow
def test_bad_input_is_a_400_naming_the_field_and_disturbs_nothing(served):
    stream, sdk_error, *answers = served["bad"]
    assert stream[-1].type == "response.completed" and stream[-1].response.output_text
    assert sdk_error["param"] == "input" and "banana" in sdk_error["message"]
    for (name, body), (status, answer) in zip(BAD_BODIES.items(), answers):
        assert status == 400, (name, answer)
        error = answer["error"]
        expected = "input" if name.startswith("input") else name
        assert error["param"] == expected, (name, error)
        assert "Traceback" not in error["message"]
    by_name = dict(zip(BAD_BODIES, (a["error"]["message"] for _, a in answers)))
    assert "input[0].type" in by_name["input"] and "banana" in by_name["input"]
    assert "input[0].content" in by_name["input.content"]
    assert "web_search" in by_name["tools"]
    assert "stateless" in by_name["previous_response_id"]


# ---- without a server -------------------------------------------------------------------------

def test_items_become_chat_messages():
    messages = messages_from_input("Be brief.", [
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text",
                                                         "text": "Look it up."}]},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "b", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "a", "output": "one"},
        {"type": "function_call_output", "call_id": "b",
         "output": [{"type": "input_text", "text": "two"}]},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Done.", "annotations": []}]},
        {"type": "message", "role": "developer", "content": "More."}])
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "Look it up.",
         "tool_calls": [
             {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "b", "type": "function", "function": {"name": "g",
                                                          "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "one"},
        {"role": "tool", "tool_call_id": "b", "content": "two"},
        {"role": "assistant", "content": "Done."},
        {"role": "developer", "content": "More."}]
    assert messages_from_input(None, "Hi") == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("given, expected", [
    ([{"type": "banana"}], "input[0].type: unknown item type 'banana'"),
    ([{"role": "user", "content": "ok"}, {"role": "user", "content": 5}],
     "input[1].content: expected `str | array`, got `int`"),
    ([{"role": "robot", "content": "x"}], "input[0].role: invalid enum value 'robot'"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}],
     "input[0]: object missing required field `call_id`"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
     "input[0].content[0].type: invalid value 'input_image' (this server takes text parts"),
    ([{"type": "item_reference", "id": "msg_1"}], "input[0]: item_reference is not supported"),
    (["text"], "input[0]: an item must be an object"),
    ([{"content": "x"}], "input[0]: an item needs a `type`"),
    ([], "input: must not be empty"),
    (5, "input: must be text or a list of items"),
])
def test_bad_items_name_the_item_and_the_field(given, expected):
    with pytest.raises(RequestError) as caught:
        messages_from_input(None, given)
    assert caught.value.param == "input"
    assert str(caught.value).startswith(expected), str(caught.value)


def test_the_request_becomes_the_chat_request_that_serves_it():
    body = ResponsesRequest.model_validate({
        "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 5, "temperature": 0,
        "tools": [WEATHER], "tool_choice": FORCED, "reasoning": {"effort": "minimal"},
        "text": {"format": {"type": "json_schema", "name": "c", "schema": CITY}},
        "include": ["message.output_text.logprobs"], "top_logprobs": 2, "ttft_slo_ms": 250})
    chat = chat_request(body)
    assert [m.role for m in chat.messages] == ["system", "user"]
    assert chat.max_completion_tokens == 5 and chat.temperature == 0 and chat.stream is False
    assert chat.tools[0].function.name == "get_weather" and chat.tool_choice.function.name == \
        "get_weather"
    assert chat.reasoning_effort == "low"
    assert chat.structured_outputs == {"json": CITY, "disable_any_whitespace": True}
    assert chat.logprobs and chat.top_logprobs == 2 and chat.ttft_slo_ms == 250
    assert chat.include_usage  # a stream's last event carries the usage
    assert chat_request(ResponsesRequest(input="Hi")).temperature == 1.0


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"), ({"store": True}, "store"),
    ({"background": True}, "background"), ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation")])
def test_what_needs_a_store_is_refused_by_name(extra, param):
    assert refused_field(ResponsesRequest(input="Hi", **extra))[0] == param
    for asks_nothing in ({"store": False}, {"previous_response_id": None},
                         {"truncation": "disabled"}, {"metadata": {"a": "b"}}):
        assert refused_field(ResponsesRequest(input="Hi", **asks_nothing)) is None


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "file_search"}]}, "tools"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}},
     "text.format")])
def test_what_the_chat_route_cannot_serve_is_named(fields, param):
    with pytest.raises(RequestError) as caught:
        chat_request(ResponsesRequest(input="Hi", **fields))
    assert caught.value.param == param


def _chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish}], **extra}


def _events(chunks: list[Any], **request: Any) -> list[dict[str, Any]]:
    shape = ResponsesShape(ResponsesRequest(input="Hi", **request), "m")

    async def source():
        for chunk in chunks:
            yield chunk

    async def collect():
        return "".join([text async for text in shape.stream(source())])

    text = asyncio.run(collect())
    return [json.loads(line[len("data: "):]) for line in text.splitlines()
            if line.startswith("data: ")]


METRICS = {"ttft_ms": 1.0, "num_cached_tokens": 3}
USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9,
                                  "total_tokens": 16}}


def test_reasoning_then_text_then_calls_stream_as_items_in_order():
    chunks = [_chunk({"role": "assistant", "content": ""}),
              _chunk({"content": "", "reasoning_content": "Think"}),
              _chunk({"content": "", "reasoning_content": "ing."}),
              _chunk({"content": "Let me"}), _chunk({"content": " check."}),
              _chunk({"content": "", "tool_calls": [{"index": 0, "id": "chatcmpl-tool-abc",
                                                     "type": "function", "function": {
                                                         "name": "f", "arguments": ""}}]}),
              _chunk({"content": "", "tool_calls": [{"index": 0, "function": {
                  "arguments": '{"a": '}}]}),
              _chunk({"content": "", "tool_calls": [{"index": 0, "function": {
                  "arguments": "1}"}}, {"index": 1, "id": "chatcmpl-tool-def",
                                       "type": "function",
                                       "function": {"name": "g", "arguments": "{}"}}]},
                     "tool_calls", metrics=METRICS),
              USAGE, "[DONE]"]
    events = _events(chunks)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta", "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    final = events[-1]["response"]
    assert final["status"] == "completed"
    reasoning, message, first, second = final["output"]
    assert reasoning["summary"] == [{"type": "summary_text", "text": "Thinking."}]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert message["content"][0]["text"] == "Let me check."
    assert (first["call_id"], first["name"], first["arguments"]) == ("call_abc", "f",
                                                                     '{"a": 1}')
    assert (second["call_id"], second["name"], second["arguments"]) == ("call_def", "g", "{}")
    assert [item["output_index"] for item in events if item["type"] ==
            "response.output_item.done"] == [0, 1, 2, 3]
    assert final["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 3},
                              "output_tokens": 9, "output_tokens_details": {
                                  "reasoning_tokens": 0}, "total_tokens": 16}
    assert final["metrics"] == METRICS


def test_logprobs_travel_with_the_text_and_a_cut_is_incomplete():
    entry = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}
    chunks = [_chunk({"role": "assistant", "content": ""}),
              {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": None,
                            "logprobs": {"content": [entry]}}]},
              {"choices": [{"index": 0, "delta": {"content": "ab"}, "finish_reason": "length",
                            "logprobs": {"content": [entry]}}], "metrics": METRICS},
              USAGE, "[DONE]"]
    events = _events(chunks, include=["message.output_text.logprobs"])
    (delta,) = [e for e in events if e["type"] == "response.output_text.delta"]
    assert delta["logprobs"] == [entry, entry]
    final = events[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"
    assert final["output"][0]["content"][0]["logprobs"] == [entry, entry]


def test_a_failure_mid_stream_is_an_error_event_and_a_failed_response():
    chunks = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Par"}),
              {"error": {"message": "the server is shutting down", "type": "x",
                         "param": None, "code": 503}}, "[DONE]"]
    events = _events(chunks)
    assert [e["type"] for e in events][-4:] == ["response.content_part.done",
                                                "response.output_item.done", "error",
                                                "response.failed"]
    assert events[-2]["code"] == "server_error"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["output"][0]["status"] == "incomplete"
    assert failed["error"]["message"] == "the server is shutting down"


def test_a_client_gone_mid_stream_closes_the_chat_stream_at_once():
    closed = []

    async def source():
        try:
            yield _chunk({"role": "assistant", "content": ""})
            yield _chunk({"content": "Hel"})
            yield _chunk({"content": "lo"})
        finally:
            closed.append(True)

    async def leave_early():
        events = ResponsesShape(ResponsesRequest(input="Hi"), "m").stream(source())
        await anext(events)
        await events.aclose()

    asyncio.run(leave_early())
    assert closed == [True]


def test_errors_from_the_chat_route_name_this_routes_fields():
    assert as_responses_error("max_completion_tokens: too many", "max_completion_tokens") == (
        "max_output_tokens: too many", "max_output_tokens")
    assert as_responses_error("reasoning_effort: not read", "reasoning_effort") == (
        "reasoning.effort: not read", "reasoning.effort")
    assert as_responses_error("This model's maximum context length ...", "max_tokens") == (
        "This model's maximum context length ...", "max_output_tokens")
    assert as_responses_error("tool_choice auto needs a parser", "tool_choice") == (
        "tool_choice auto needs a parser", "tool_choice")


def test_a_whole_chat_completion_becomes_a_response():
    shape = ResponsesShape(ResponsesRequest(input="Hi", tools=[WEATHER]), "m")
    body = shape.whole({
        "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
            "role": "assistant", "content": "Checking.", "reasoning_content": "Hm.",
            "tool_calls": [{"id": "chatcmpl-tool-xyz", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Rome"}'}}]}}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9},
        "metrics": METRICS})
    assert [item["type"] for item in body["output"]] == ["reasoning", "message",
                                                          "function_call"]
    assert body["output"][2]["call_id"] == "call_xyz"
    assert body["status"] == "completed" and body["usage"]["total_tokens"] == 9
    assert body["tools"] == [WEATHER] and body["tool_choice"] == "auto"
