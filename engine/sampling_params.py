"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What to sample and when to stop. Mirrors the OpenAI / vLLM field names.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes a request's random draws reproducible regardless of batching or preemption.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.n != 1:
            raise ValueError(f"n must be 1 (only one completion per request is supported), got {self.n}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
