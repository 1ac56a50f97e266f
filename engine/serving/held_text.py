"""Text a stream holds back: the tail of an output that may be the start of a marker (a tool
call's `<tool_call>`, a reasoning model's `</think>`) is not sent until it turns out to be
text or the marker."""

from __future__ import annotations


def held_from(text: str, marker: str) -> int:
    """Where a tail of `text` that could be the start of `marker` begins (len(text): none)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return len(text) - size
    return len(text)
