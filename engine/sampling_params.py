"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math

import msgspec

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by a smaller one
# overflows float32 to inf, and softmax of inf is NaN, which no multinomial draw accepts.
SAMPLING_EPS = 1e-5
# Integers cross process boundaries as msgpack int64; larger ones could not be sent to a worker.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What to sample and when to stop. Mirrors the OpenAI / vLLM field names.

    ``temperature`` below ``SAMPLING_EPS`` (1e-5) means greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
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
        self._check_numbers()
        if self.n != 1:
            raise ValueError(f"n must be 1 (only one completion per request is supported), got {self.n}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    def _check_numbers(self) -> None:
        # NaN passes every comparison below (NaN < 0 is False), so it is refused up front.
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        for name in ("max_tokens", "top_k", "seed", "n"):
            value = getattr(self, name)
            if value is None and name == "seed":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if not _INT64_MIN <= value <= _INT64_MAX:
                raise ValueError(f"{name} must fit in 64 bits, got {value}")
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) \
                    or not 0 <= token_id <= _INT64_MAX:
                raise ValueError(f"stop_token_ids must be non-negative 64-bit integers, "
                                 f"got {token_id!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
