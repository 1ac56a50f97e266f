"""The one percentile every benchmark reports."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values``, linearly interpolated between the two
    nearest ranks (numpy's default, as vLLM's benchmarks report); None when there are none."""
    return float(np.percentile(values, q)) if len(values) else None
