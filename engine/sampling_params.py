"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math

import msgspec

from engine.structured_output.params import StructuredOutputsParams

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by a smaller one
# overflows float32 to inf, and softmax of inf is NaN, which no multinomial draw accepts.
SAMPLING_EPS = 1e-5
# Integers cross process boundaries as msgpack int64; larger ones could not be sent to a worker.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# OpenAI's bounds: at most 20 alternatives per position, biases within +-100, penalties +-2.
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0
# A repetition penalty divides or multiplies logits: beyond these a float32 logit overflows to
# inf (1e-40 divides 30 into 3e41), and the row's softmax is NaN.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What to sample and when to stop. Mirrors the OpenAI / vLLM field names.

    ``temperature`` below ``SAMPLING_EPS`` (1e-5) means greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes a request's random draws reproducible regardless of batching or preemption.

    Logits are processed in vLLM's order: ``logit_bias`` and ``min_tokens`` (EOS and
    ``stop_token_ids`` masked until that many tokens exist), then the penalties (repetition over
    prompt and output, frequency and presence over the output), then temperature, ``min_p``,
    ``top_k`` and ``top_p``. ``logprobs`` (k alternatives, 0..20) are the log-softmax of the
    logits after temperature and the penalties, before the min_p / top-k / top-p filters (the
    sampled token's own logprob is always returned, even if outside the top k);
    ``prompt_logprobs`` are the raw model's, for every prompt token but the first.
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
    # Sample this many and return the n with the highest cumulative logprob (vLLM v0's best_of).
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    # token id -> added to its logit (OpenAI's logit_bias).
    logit_bias: dict[int, float] = {}
    # Top alternatives returned per sampled token / per prompt token (None: no logprobs).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # The output must match a JSON schema, a regex, a choice or a grammar (engine.structured_output).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_numbers()
        if self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                             f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        self._check_logit_bias()

    def _check_numbers(self) -> None:
        # NaN passes every comparison below (NaN < 0 is False), so it is refused up front.
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        for name in ("max_tokens", "top_k", "seed", "n", "best_of", "min_tokens", "logprobs",
                     "prompt_logprobs"):
            value = getattr(self, name)
            if value is None and name in ("seed", "best_of", "logprobs", "prompt_logprobs"):
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

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        checked: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            # JSON object keys are strings: OpenAI's {"50256": -100} names token 50256.
            token_id = int(key) if isinstance(key, str) and key.strip().isdigit() else key
            if isinstance(token_id, bool) or not isinstance(token_id, int) \
                    or not 0 <= token_id <= _INT64_MAX:
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), "
                                 f"got {key!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                    or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got "
                                 f"{bias!r} for token {key!r}")
            checked[token_id] = float(bias)
        self.logit_bias = checked

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler changes this request's logits before temperature (bias,
        penalties; min_tokens is the scheduler's blocked_token_ids)."""
        return bool(self.logit_bias) or self.has_penalties

    @property
    def num_samples(self) -> int:
        """Engine requests per prompt: best_of when set, else n."""
        return self.best_of or self.n

    @property
    def ranks_samples(self) -> bool:
        """Whether more samples are drawn than returned (best_of > n)."""
        return self.num_samples > self.n

    def child(self, index: int) -> SamplingParams:
        """The parameters of the index-th of the prompt's parallel samples: one completion
        each, seeded apart (seed + index, as vLLM) so that seeded samples differ and stay
        reproducible; with best_of, each computes the logprob it is ranked by."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        logprobs = 0 if self.ranks_samples and self.logprobs is None else self.logprobs
        return msgspec.structs.replace(self, n=1, best_of=None, seed=seed, logprobs=logprobs)
