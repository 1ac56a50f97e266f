"""A tool call's arguments streamed while the model writes them
(engine/serving/tool_calls/partial_json.py): what is settled of the serialization only grows,
is always a prefix of the whole call's, and holds back what a continuation could still change."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.serving.tool_calls.partial_json import canonical, settled_prefix

SCALARS = (st.none() | st.booleans() | st.integers(-10**6, 10**6)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=10)
OBJECTS = st.dictionaries(st.text(max_size=5), VALUES, max_size=4)
# How models lay their JSON out: compact, Python's default, and stray whitespace everywhere.
LAYOUTS = [(",", ":"), (", ", ": "), (" ,\n ", " :\t")]


@given(OBJECTS, st.sampled_from(LAYOUTS), st.booleans())
def test_what_is_settled_only_grows_into_the_whole_serialization(value, layout, ascii):
    raw = json.dumps(value, separators=layout, ensure_ascii=ascii)
    whole = canonical(raw)
    assert whole == json.dumps(value, ensure_ascii=False)
    settled = [settled_prefix(raw[:n]) for n in range(len(raw) + 1)]
    assert settled[-1] == whole
    for shorter, longer in zip(settled, settled[1:]):
        assert longer.startswith(shorter)


@pytest.mark.parametrize("raw, settled", [
    ('{"n": 12', '{"n": '),                      # more digits may follow
    ('{"n": 12.', '{"n": '),
    ('{"n": 1e5}', '{"n": 100000.0}'),            # written as json.dumps writes it
    ('{"n": 1e5, "b": tr', '{"n": 100000.0, "b": '),
    ('{"ke', '{'),                                # a key counts once whole
    ('{"s": "a\\u00', '{"s": "a'),                 # an escape cut in half
    ('{"s": "a\\', '{"s": "a'),
    ('{"s": "\\ud83d', '{"s": "'),               # a high surrogate waits for its pair
    ('{"s": "\\ud83d\\ude00"}', '{"s": "\U0001F600"}'),
    ('{"s": "caf\\u00e9\\n', '{"s": "café\\n'),
    ('{"a":{"b":[1,2', '{"a": {"b": [1, '),
    ('  {"a": 1}  trailing', '{"a": 1}'),
    ('"not an object"', ''), ('[1, 2]', ''), ('', ''),
])
def test_what_a_continuation_could_change_is_held_back(raw, settled):
    assert settled_prefix(raw) == settled


def test_a_key_written_twice_stays_twice_and_means_what_json_loads_reads():
    raw = '{"a": 1, "b": 2, "a": 3}'
    assert canonical(raw) == raw
    assert json.loads(canonical(raw)) == json.loads(raw) == {"a": 3, "b": 2}


def test_only_a_whole_object_is_canonical():
    assert canonical('{"a": [1, 2') is None and canonical("[]") is None
    assert canonical('{"a":{}}') == '{"a": {}}'
