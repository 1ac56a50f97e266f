"""A step's allowed tokens for one request: packed bits, as xgrammar fills them (bit `t % 32` of
int32 word `t // 32`, little-endian), sent to the workers as bytes in the ScheduledRequest."""

from __future__ import annotations

import numpy as np


def words_for(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_ids(mask: bytes) -> np.ndarray:
    """The token ids a mask allows, ascending."""
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
    return np.flatnonzero(bits)


def first_allowed_from(mask: bytes, token_id: int, vocab_size: int) -> int | None:
    """The first allowed id at or after `token_id`, wrapping around the vocabulary (None: the
    mask allows nothing)."""
    allowed = allowed_ids(mask)
    allowed = allowed[allowed < vocab_size]
    if not allowed.size:
        return None
    at = int(np.searchsorted(allowed, token_id))
    return int(allowed[at % allowed.size])
