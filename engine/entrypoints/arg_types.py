"""argparse value types that check a flag's range: a value out of range is a usage error naming
the flag and the bound (``argument -tp/--tensor-parallel-size: must be >= 1, got 0``, exit code
2) before any model loads, never a value silently clamped into range."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """Integers in [low, high] (no upper bound when high is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


def float_in(low: float, high: float = math.inf, *, low_open: bool = False,
             high_open: bool = False) -> Callable[[str], float]:
    """Finite floats between low and high, each end closed unless said open."""
    if math.isinf(high):
        bound = f"> {low:g}" if low_open else f">= {low:g}"
    else:
        bound = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):  # NaN would pass every comparison below
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        if value < low or value > high or (low_open and value == low) or \
                (high_open and value == high):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


positive_int = int_in(1)
non_negative_int = int_in(0)
positive_float = float_in(0.0, low_open=True)
non_negative_float = float_in(0.0)
# A fraction that may be 0 or 1 (stubborn fraction: 0 = never vote, 1 = vote at every layer).
unit_interval = float_in(0.0, 1.0)
