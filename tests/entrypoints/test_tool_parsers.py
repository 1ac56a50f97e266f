"""The tool-call formats read out of model text (engine/serving/tool_calls/parsers.py), as a
stream sees it grow and at its end: content up to the first call, calls as they complete, a
marker's first characters held back, malformed calls left as plain text; and the parser a chat
template's format picks."""

from __future__ import annotations

import json

import pytest

from engine.serving.tool_calls.parsers import (FunctionCall, HermesParser, Llama3JsonParser,
                                               MistralParser, parser_for_template)

WEATHER = FunctionCall("get_weather", json.dumps({"city": "Paris"}))
TIME = FunctionCall("get_time", json.dumps({"zone": "CET"}))


def _grow(parser, text):
    """The parse after each character, then at the end."""
    return [parser.parse(text[:n], False) for n in range(len(text) + 1)], parser.parse(text, True)


def test_hermes_reads_calls_after_content_and_holds_a_markers_start_back():
    text = ('Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}'
            '</tool_call>')
    steps, final = _grow(HermesParser(), text)
    assert final.content_end == len("Let me look. ") and final.calls == (WEATHER, TIME)
    # While streaming: content never past the marker, even its first characters ("<tool")...
    assert all(step.content_end <= len("Let me look. ") for step in steps)
    assert steps[len("Let me look. <tool")].content_end == len("Let me look. ")
    # ...and each call appears once its closing tag has.
    first_close = text.index("</tool_call>") + len("</tool_call>")
    assert steps[first_close - 1].calls == () and steps[first_close].calls == (WEATHER,)
    # A "<" that turns out not to be a marker is released.
    assert HermesParser().parse("a < b", False).content_end == len("a < b")
    assert HermesParser().parse("a <", False).content_end == len("a ")


@pytest.mark.parametrize("text", ['<tool_call>{"name": "get_weather", "argu</tool_call>',
                                  '<tool_call>{"arguments": {}}</tool_call>',
                                  '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
                                  '<tool_call>{"name": "f", "arguments": {"a": 1}'])
def test_hermes_malformed_calls_are_plain_text_at_the_end(text):
    final = HermesParser().parse(text, True)
    assert final.content_end == len(text) and final.calls == ()


def test_an_unclosed_but_whole_hermes_call_counts_at_the_end():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert HermesParser().parse(text, True).calls == (WEATHER,)
    assert HermesParser().parse(text, False).calls == ()


def test_llama3_json_reads_calls_separated_by_semicolons():
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_time", "parameters": {"zone": "CET"}}')
    steps, final = _grow(Llama3JsonParser(), text)
    assert final.content_end == 0 and final.calls == (WEATHER, TIME)
    assert all(step.content_end == 0 and step.calls == () for step in steps)
    plain = "The weather is fine."
    assert Llama3JsonParser().parse(plain, True).content_end == len(plain)
    assert Llama3JsonParser().parse(plain[:3], False).content_end == 3
    assert Llama3JsonParser().parse('{"name": "f", "parameters": ', True).calls == ()


def test_mistral_reads_a_list_after_its_marker():
    text = ('Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": {"zone": "CET"}}]')
    final = MistralParser().parse(text, True)
    assert final.content_end == len("Sure.") and final.calls == (WEATHER, TIME)
    assert MistralParser().parse(text[:12], False).content_end == len("Sure.")
    assert MistralParser().parse("Sure.[TOOL", False).content_end == len("Sure.")
    broken = "Sure.[TOOL_CALLS][{"
    assert MistralParser().parse(broken, True).content_end == len(broken)
    assert MistralParser.keeps_special_tokens  # its marker is a special token


def test_arguments_written_as_a_json_string_are_read_too():
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>'
    assert HermesParser().parse(text, True).calls == (WEATHER,)


def test_the_template_picks_the_parser_when_exactly_one_fits():
    assert parser_for_template("... <tool_call>{{ call | tojson }}</tool_call> ...") == "hermes"
    assert parser_for_template("{% if x %}<|python_tag|>{% endif %}") == "llama3_json"
    assert parser_for_template("[TOOL_CALLS]") == "mistral"
    assert parser_for_template("<tool_call> and [TOOL_CALLS]") is None  # ambiguous
    assert parser_for_template("{{ messages }}") is None and parser_for_template(None) is None
