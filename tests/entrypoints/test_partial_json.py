"""A tool call's arguments streamed while the model writes them
(engine/serving/tool_calls/partial_json.py): what is settled of the serialization only grows,
is always a prefix of the whole call's, and holds back what a continuation could still change;
a reader that reads on from its last read settles what a fresh read settles."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.serving.tool_calls.partial_json import (ArgumentReaders, SettledReader, canonical,
                                                   settled_prefix)

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


@given(OBJECTS, st.sampled_from(LAYOUTS), st.booleans(), st.text(max_size=8),
       st.integers(0, 10**6), st.lists(st.integers(1, 9), max_size=120))
def test_a_reader_read_on_settles_what_a_fresh_read_settles(value, layout, ascii, garbage,
                                                            break_at, steps):
    """Over the updates of a stream (a few characters each), and through text that stops being
    JSON somewhere (a model's mistake) or goes on after the object."""
    raw = json.dumps(value, separators=layout, ensure_ascii=ascii)
    cut_at = break_at % (len(raw) + 1)
    raw = raw[:cut_at] + garbage + raw[cut_at:]
    reader, cut = SettledReader(), 0
    for step in [*steps, len(raw)]:
        cut = min(len(raw), cut + step)
        assert reader.read(raw[:cut]) == settled_prefix(raw[:cut]), raw[:cut]


@pytest.mark.parametrize("raw, settled", [
    ('{"s": "one\\ntwo", "t": 1}', '{"s": "one\\ntwo", "t": 1}'),
    ('{"s": "one\\ntwo\nthree", "t": 1}', '{"s": "one\\ntwo'),  # a raw newline: not JSON
    ('{"a": 1 "b": 2}', '{"a": 1'),
    ('{"a": [1, 2}', '{"a": [1, 2'),
])
def test_text_that_stops_being_json_settles_nothing_more(raw, settled):
    reader = SettledReader()
    for cut in range(len(raw) + 1):
        reader.read(raw[:cut])
    assert reader.read(raw) == settled_prefix(raw) == settled
    assert canonical(raw) is None or settled == raw


def test_a_reader_reads_on_and_starts_over_only_when_the_text_does_not_continue(monkeypatch):
    starts = []
    start_over = SettledReader._start_over

    def counted(self, text):
        starts.append(text)
        start_over(self, text)

    monkeypatch.setattr(SettledReader, "_start_over", counted)
    raw = json.dumps({"city": "Paris", "days": [1, 2, 3], "note": "x" * 50})
    reader = SettledReader()
    for cut in range(len(raw) + 1):
        assert reader.read(raw[:cut]) == settled_prefix(raw[:cut])
    assert reader.whole
    # Probe: the reader was made once and read on; each fresh read made one of its own.
    assert starts.count("") == 1 + (len(raw) + 1)
    assert len(starts) == 1 + (len(raw) + 1)
    other = '{"city": "Rome"}'
    assert reader.read(other) == other and starts[-1] == other


def test_a_requests_readers_read_each_choice_on_from_its_own_last_read(monkeypatch):
    """Two choices' calls written in turns (n > 1): each update reads on from that choice's
    last read; a finished call's canonical text is its stream's reader read to the end."""
    readers = ArgumentReaders()
    made = []
    init = SettledReader.__init__

    def counted(self):
        made.append(self)
        init(self)

    monkeypatch.setattr(SettledReader, "__init__", counted)
    first = '{"city": "Paris", "days": 3}'
    second = '{"city": "Tokyo", "units": "metric"}'
    for cut in range(1, max(len(first), len(second)) + 1):
        for raw in (first, second):
            assert readers.settled(raw[:cut]) == settled_prefix(raw[:cut])
    made_by_fresh_reads = 2 * max(len(first), len(second))  # settled_prefix's own
    assert len(made) - made_by_fresh_reads == 2  # probe: one reader per choice, read on
    assert readers.canonical(first + "}  ") == first and readers.canonical(second) == second
    assert len(made) - made_by_fresh_reads == 2
