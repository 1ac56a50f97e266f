"""Requests handed to an in-process engine at their offsets, from a thread, as the HTTP reader
thread hands them over: the SLO monitor sees arrivals that land in the middle of a step."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any


def submit_on_schedule(engine: Any, arrivals: Sequence[tuple[float, Any]],
                       start: float | None = None) -> threading.Thread:
    """Starts a daemon thread that submits each (offset s, Request) at `start` + offset
    (default: now), stamping its arrival time then; returns the thread."""
    begin = time.monotonic() if start is None else start

    def submit() -> None:
        for offset, request in arrivals:
            time.sleep(max(0.0, begin + offset - time.monotonic()))
            request.arrival_time = time.monotonic()
            engine.submit_request(request)

    thread = threading.Thread(target=submit, name="bench-arrivals", daemon=True)
    thread.start()
    return thread
