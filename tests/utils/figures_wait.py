"""Waiting for a benchmark's first figures (engine/benchmarks/measure/figures.py's JSON-lines files), so
that a test
can kill it right after and check that what it measured survived."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.benchmarks.measure.figures import read_figures


def wait_for_figures(proc: subprocess.Popen, figures: Path,
                     ready: Callable[[list[dict[str, Any]]], bool], what: str,
                     timeout_s: float = 240.0) -> None:
    """Returns once ``ready(records of figures)``; fails if ``proc`` ends first or the time
    runs out (``what`` names the awaited figure in the message)."""
    deadline = time.monotonic() + timeout_s
    while not ready(read_figures(figures)):
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.01)
