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


def _openings(parser, text):
    """Each growing prefix's opening name, and where it first appears."""
    steps, _ = _grow(parser, text)
    names = [step.opening for step in steps]
    first = next(n for n, name in enumerate(names) if name is not None)
    return names, first


@pytest.mark.parametrize("parser, text, name_end", [
    (HermesParser(), 'Ok. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
                     '</tool_call>', 'Ok. <tool_call>{"name": "get_weather"'),
    (Llama3JsonParser(), '<|python_tag|>{"name": "get_weather", "parameters": {"city": '
                         '"Paris"}}', '<|python_tag|>{"name": "get_weather"'),
    (MistralParser(), 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '
                      '"Paris"}}]', 'Sure.[TOOL_CALLS][{"name": "get_weather"'),
])
def test_a_calls_name_is_known_once_written_before_its_arguments(parser, text, name_end):
    """A stream sends a call's id and name as soon as its name is written (as vLLM does),
    so a tool-calling turn's first visible output does not wait for its arguments."""
    names, first = _openings(parser, text)
    assert first == len(name_end)  # the name's closing quote, not a character before
    assert names[first] == "get_weather"
    final = parser.parse(text, True)
    assert final.calls == (WEATHER,) and final.opening is None
    if isinstance(parser, HermesParser):  # a hermes call is whole at its closing tag
        assert names[len(text) - len("</tool_call>") - 1] == "get_weather"
        assert names[-1] is None and parser.parse(text, False).calls == (WEATHER,)
    else:  # the others are whole at the end: the name stays the opening till then
        assert all(name == "get_weather" for name in names[first:])


def test_a_name_written_as_an_escaped_string_is_decoded():
    text = '<tool_call>{"name": "say_\\"hi\\"", "arg'
    assert HermesParser().parse(text, False).opening == 'say_"hi"'
    assert HermesParser().parse('<tool_call>{"arguments": {}, "na', False).opening is None


def test_required_calls_stream_one_by_one_and_a_cut_short_list_keeps_what_was_written():
    """`tool_choice: required` holds the output to a JSON list of {"name", "parameters"}: each
    call counts once its object is whole, the next one's name as soon as it is written; cut
    short (max_tokens), the calls written stay calls, the last with its arguments as far as
    they got (what a stream had sent by then), as a named function's do."""
    from engine.serving.tool_calls.calling import tool_calling

    tools = [{"type": "function", "function": {"name": name}} for name in ("get_weather",
                                                                           "get_time")]
    required = tool_calling(tools, "required", None, None)
    text = ('[{"name":"get_weather","parameters":{"city":"Paris"}},'
            '{"name":"get_time","parameters":{"zone":"CET"}}]')
    first_whole = text.index("},{") + 1  # the first call's closing brace written
    steps, final = _grow(required, text)
    assert final.calls == (WEATHER, TIME) and final.content_end == 0
    assert [step.opening for step in steps[:len('[{"name":"get_weather')]] == [None] * 21
    assert steps[len('[{"name":"get_weather"')].opening == "get_weather"
    assert steps[first_whole - 1].calls == () and steps[first_whole].calls == (WEATHER,)
    assert steps[first_whole].opening is None
    assert steps[len(text) - 2].opening == "get_time" and steps[-1].calls == (WEATHER, TIME)
    assert all(step.content_end == 0 for step in steps)

    cut = required.parse(text[:first_whole + len(',{"name":"get_time","parameters":{"zo')],
                         True)
    # What a stream had sent of the arguments: their settled part (a key is whole or not yet).
    assert cut.calls == (WEATHER, FunctionCall("get_time", '{')) and cut.content_end == 0
    assert required.parse('[{"name":"get_wea', True).content_end == len('[{"name":"get_wea')


@pytest.mark.parametrize("parser, text", [
    (HermesParser(), '<tool_call>{"name": "get_weather", "arguments": {"city":"Paris",\n'
                     '"days": [1, 2.50]}}</tool_call>'),
    (Llama3JsonParser(), '{"name": "get_weather", "parameters": {"city": "Paris", "days": '
                         '[1, 2.50]}}'),
    (MistralParser(), '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
                      '"days": [1, 2.50]}}]'),
])
def test_a_calls_arguments_settle_as_written_and_add_up_to_the_whole_calls(parser, text):
    """What a stream sends of an opening call's arguments only grows, and the whole call's
    arguments continue it: a client that appends the fragments gets the call's arguments,
    re-serialized (`2.50` is `2.5`, the model's newline gone) as a whole response has them."""
    steps, final = _grow(parser, text)
    settled = [step.opening_arguments for step in steps if step.opening is not None]
    assert len(set(settled)) > 10  # probe: they grew piece by piece while being written
    assert all(longer.startswith(shorter) for shorter, longer in zip(settled, settled[1:]))
    (call,) = final.calls
    assert call.arguments == '{"city": "Paris", "days": [1, 2.5]}'
    assert call.arguments.startswith(settled[-1])
    assert {'{"city": "P', '{"city": "Pa', '{"city": "Par'} <= set(settled)  # a string as it comes
