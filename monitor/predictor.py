"""TTFT predictor: time to prefill `tokens` tokens on this model and machine, `a * tokens + c`.

The line is fitted by least squares on (tokens, seconds) points: from `sloserve calibrate`
(saved as JSON), or online from the engine's own prefill step timings. A request's remaining TTFT
counts only the tokens it still has to prefill.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

# Before any measurement: pessimistic for a 135M model on 2 CPU cores (about 1 ms per token plus
# 50 ms per step), so that slack is underestimated rather than overestimated.
DEFAULT_SECONDS_PER_TOKEN = 1e-3
DEFAULT_INTERCEPT_S = 0.05


@dataclass(frozen=True)
class LinearTTFT:
    seconds_per_token: float = DEFAULT_SECONDS_PER_TOKEN
    intercept_s: float = DEFAULT_INTERCEPT_S
    # Coefficient of determination of the fit that produced it (None: not fitted).
    r2: float | None = None

    def predict(self, tokens: int) -> float:
        """Seconds to prefill `tokens` more tokens (0 when none are left)."""
        if tokens <= 0:
            return 0.0
        return max(0.0, self.seconds_per_token * tokens + self.intercept_s)

    @classmethod
    def fit(cls, points: Iterable[tuple[int, float]]) -> LinearTTFT:
        """Least-squares line through (tokens, seconds); needs two distinct token counts."""
        pts = list(points)
        xs = [float(x) for x, _ in pts]
        ys = [float(y) for _, y in pts]
        n = len(pts)
        if n < 2 or len(set(xs)) < 2:
            raise ValueError(f"fitting a line needs points at two or more token counts, "
                             f"got {sorted(set(xs))}")
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
        slope = sxy / sxx
        intercept = my - slope * mx
        if intercept < 0:
            # Prefill time grows faster than linearly at the top (attention is quadratic), which
            # pulls a free intercept below zero and predicts 0 s for short prompts. A step never
            # costs less than nothing: refit through the origin instead.
            slope = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
            intercept = 0.0
        ss_tot = sum((y - my) ** 2 for y in ys)
        ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys))
        r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
        return cls(seconds_per_token=slope, intercept_s=intercept, r2=r2)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LinearTTFT:
        try:
            data = json.loads(Path(path).read_text())
            model = cls(seconds_per_token=float(data["seconds_per_token"]),
                        intercept_s=float(data["intercept_s"]), r2=data.get("r2"))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"ttft model {str(path)!r} is not a calibration file written by "
                             f"`sloserve calibrate`: {exc}") from exc
        if model.seconds_per_token <= 0:
            raise ValueError(f"ttft model {str(path)!r}: seconds_per_token must be > 0, "
                             f"got {model.seconds_per_token}")
        return model


class OnlineTTFT:
    """Refits the line from the engine's observed prefill steps (a sliding window), starting
    from a seed line until enough distinct step sizes were seen. Readers get the current line by
    reference; `observe` replaces it, never mutates it."""

    def __init__(self, seed: LinearTTFT | None = None, window: int = 256,
                 refit_every: int = 8) -> None:
        self.current = seed or LinearTTFT()
        self._points: deque[tuple[int, float]] = deque(maxlen=window)
        self._refit_every = refit_every
        self._since_fit = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self._points.append((tokens, seconds))
        self._since_fit += 1
        if self._since_fit < self._refit_every:
            return
        self._since_fit = 0
        try:
            fitted = LinearTTFT.fit(self._points)
        except ValueError:  # all steps the same size so far
            return
        if fitted.seconds_per_token > 0:
            self.current = fitted

    def predict(self, tokens: int) -> float:
        return self.current.predict(tokens)
