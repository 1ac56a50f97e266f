"""The API key check the server's routes, its load shedding and a fleet's ingress share."""

from __future__ import annotations

import hmac


def key_matches(given: bytes, expected: bytes | None) -> bool:
    """Whether an Authorization header's value is the expected one (None: no key set). In
    constant time: how long a wrong key takes to refuse says nothing about the right one. Bytes:
    compare_digest refuses non-ASCII str, and a header may hold anything."""
    return expected is None or hmac.compare_digest(given, expected)
