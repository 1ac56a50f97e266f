"""One timed step as the step model's fits see it (monitor.predictor, monitor.speed_drift)."""

from __future__ import annotations

from typing import NamedTuple


class StepPoint(NamedTuple):
    """One timed step as the fit sees it (see monitor.predictor: attention_work, decode_context,
    step_point)."""

    tokens: float
    attention: float
    decode_context: float
    seconds: float
    # Share of the layers the step ran: the intercept's (and the floor's) feature.
    share: float = 1.0

    @property
    def full_tokens(self) -> float:
        """Tokens of the whole-step equivalent: partial points of one size share it."""
        return self.tokens / self.share
