"""Seeded request traces for the SLO-attainment benchmark.

A trace is the list of requests one benchmark run replays: when each arrives (an offset from the
trace start), its prompt as token ids, how many tokens it generates, its TTFT SLO and, optionally,
its TPOT (time per output token) objective. Every policy in a comparison replays the identical
trace, so traces are generated once from a seed, saved as JSONL and reloaded, never regenerated
per policy.

Prompts are windows of real English text (`engine/benchmarks/corpus.txt`) tokenized by the model's
own
tokenizer, cut to the exact sampled length: random token ids would exercise the model on inputs it
never sees in service, and re-tokenizing decoded text would not give the length back exactly.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

# Shared with the soak clients (bench/e2e/soak_clients.py).
CORPUS_PATH = Path(__file__).resolve().parent.parent / "corpus.txt"

# Arrival processes; see `arrival_offsets`.
Arrival = Literal["poisson", "gamma"]


class Tokenizer(Protocol):
    """What traces need from a tokenizer: HF tokenizers satisfy it."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


# ---------------------------------------------------------------- prompt-length distributions


@dataclass(frozen=True)
class Fixed:
    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"Fixed: n must be >= 1, got {self.n}")

    def sample(self, rng: np.random.Generator) -> int:
        return self.n


@dataclass(frozen=True)
class Uniform:
    """Integer lengths uniform on [lo, hi], both ends included."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"Uniform: need 1 <= lo <= hi, got lo={self.lo}, hi={self.hi}")

    def sample(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.lo, self.hi + 1))


@dataclass(frozen=True)
class LogNormal:
    """round(median * exp(sigma * N(0, 1))), clipped to [lo, hi]. Prompt lengths in service are
    heavy-tailed; the clip keeps the tail inside the model's context and the benchmark's time."""

    median: float
    sigma: float
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if self.median <= 0 or self.sigma < 0:
            raise ValueError(f"LogNormal: need median > 0 and sigma >= 0, "
                             f"got median={self.median}, sigma={self.sigma}")
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"LogNormal: need 1 <= lo <= hi, got lo={self.lo}, hi={self.hi}")

    def sample(self, rng: np.random.Generator) -> int:
        n = round(self.median * math.exp(self.sigma * float(rng.standard_normal())))
        return min(self.hi, max(self.lo, n))


LengthDist = Fixed | Uniform | LogNormal


def dist_median(dist: LengthDist) -> int:
    """A representative length (used to turn a class's isolated TTFT into one SLO scale)."""
    if isinstance(dist, Fixed):
        return dist.n
    if isinstance(dist, Uniform):
        return (dist.lo + dist.hi) // 2
    return min(dist.hi, max(dist.lo, round(dist.median)))


# ---------------------------------------------------------------- SLO rules


@dataclass(frozen=True)
class AbsoluteSLO:
    ms: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ms) and self.ms > 0):
            raise ValueError(f"AbsoluteSLO: ms must be a positive number, got {self.ms}")

    def slo_ms(self, prompt_len: int, predict_ttft_s: Callable[[int], float]) -> float | None:
        return float(self.ms)


@dataclass(frozen=True)
class IsolatedMultipleSLO:
    """A multiple of the prompt's predicted TTFT on an idle engine, so the SLO is attainable
    by construction on this machine; the floor keeps short prompts from getting deadlines tighter
    than scheduling and HTTP noise."""

    multiple: float
    floor_ms: float = 0.0

    def __post_init__(self) -> None:
        if not (self.multiple > 0 and self.floor_ms >= 0):
            raise ValueError(f"IsolatedMultipleSLO: need multiple > 0 and floor_ms >= 0, "
                             f"got multiple={self.multiple}, floor_ms={self.floor_ms}")

    def slo_ms(self, prompt_len: int, predict_ttft_s: Callable[[int], float]) -> float | None:
        return max(float(self.floor_ms), self.multiple * predict_ttft_s(prompt_len) * 1000.0)


@dataclass(frozen=True)
class NoSLO:
    def slo_ms(self, prompt_len: int, predict_ttft_s: Callable[[int], float]) -> float | None:
        return None


SLORule = AbsoluteSLO | IsolatedMultipleSLO | NoSLO


@dataclass(frozen=True)
class ChunkMultipleTPOT:
    """A TPOT objective of `multiple` times the isolated prefill time of a `tokens`-token chunk:
    how long a decoding stream may wait between two of its tokens, measured in the prefill work
    that may run in between. One objective per tier (it does not depend on the prompt), so
    resolving it draws no random numbers."""

    tokens: int
    multiple: float

    def __post_init__(self) -> None:
        if not (self.tokens >= 1 and self.multiple > 0):
            raise ValueError(f"ChunkMultipleTPOT: need tokens >= 1 and multiple > 0, "
                             f"got tokens={self.tokens}, multiple={self.multiple}")

    def slo_ms(self, predict_ttft_s: Callable[[int], float],
               max_prompt_len: int | None = None) -> float:
        # No chunk is longer than the longest prompt a trace may hold (a tiny model's context).
        tokens = self.tokens if max_prompt_len is None else min(self.tokens, max_prompt_len)
        return self.multiple * predict_ttft_s(tokens) * 1000.0


TPOTRule = ChunkMultipleTPOT


@dataclass(frozen=True)
class TierSpec:
    name: str
    share: float  # fraction of the trace's requests
    prompt_len: LengthDist
    output_tokens: int  # max_tokens, generated with ignore_eos
    slo: SLORule
    tpot_slo: TPOTRule | None = None  # None: the tier's requests have no TPOT objective

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("TierSpec: name must not be empty")
        if not 0 < self.share <= 1:
            raise ValueError(f"tier {self.name!r}: share must be in (0, 1], got {self.share}")
        if self.output_tokens < 1:
            raise ValueError(f"tier {self.name!r}: output_tokens must be >= 1, "
                             f"got {self.output_tokens}")

    def describe(self) -> dict[str, Any]:
        """JSON-serialisable description, stored in the trace's meta."""
        return {"name": self.name, "share": self.share, "output_tokens": self.output_tokens,
                "prompt_len": _tagged(self.prompt_len), "slo": _tagged(self.slo),
                "tpot_slo": None if self.tpot_slo is None else _tagged(self.tpot_slo)}


def _tagged(obj: Any) -> dict[str, Any]:
    return {"kind": type(obj).__name__, **asdict(obj)}


# ---------------------------------------------------------------- traces


@dataclass
class TraceRequest:
    request_id: str
    tier: str
    arrival_s: float  # offset from the trace start, seconds, non-decreasing over the trace
    prompt_token_ids: list[int]
    output_tokens: int  # max_tokens, generated with ignore_eos
    ttft_slo_ms: float | None  # None: no SLO
    tpot_slo_ms: float | None = None  # None: no TPOT objective
    # Requests of one session (a conversation) share their prompts' prefix: an HTTP replay
    # gives them one prefix salt, so a server's prefix cache finds each turn's history.
    session: str | None = None


_REQUEST_FIELDS = ("request_id", "tier", "arrival_s", "prompt_token_ids", "output_tokens",
                   "ttft_slo_ms", "tpot_slo_ms", "session")
# Traces written before TPOT objectives (or sessions) existed lack these; they load as None.
_OPTIONAL_FIELDS = frozenset({"tpot_slo_ms", "session"})


@dataclass
class Trace:
    requests: list[TraceRequest]
    meta: dict[str, Any] = field(default_factory=dict)  # workload, seed, rate, ... (JSON-serialisable)

    def __post_init__(self) -> None:
        # Runners rely on both: they sleep to each arrival in order and key results by id.
        seen: set[str] = set()
        prev = 0.0
        for r in self.requests:
            if r.request_id in seen:
                raise ValueError(f"duplicate request_id {r.request_id!r}")
            seen.add(r.request_id)
            if r.arrival_s < prev:
                raise ValueError(f"request {r.request_id!r}: arrival_s {r.arrival_s} is before "
                                 f"the previous request's {prev}; arrivals must not decrease")
            prev = r.arrival_s

    @property
    def duration_s(self) -> float:
        """Arrival offset of the last request (the span the arrivals cover)."""
        return self.requests[-1].arrival_s if self.requests else 0.0

    @property
    def mean_rate(self) -> float | None:
        """Requests per second over the arrival span; None when every request arrives at 0."""
        span = self.duration_s
        return len(self.requests) / span if span > 0 else None

    def tier_names(self) -> list[str]:
        """Tiers in order of first appearance."""
        return list(dict.fromkeys(r.tier for r in self.requests))

    def save(self, path: str | Path) -> None:
        """JSONL: first line {"meta": ...}, then one request per line."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps({"meta": self.meta}, allow_nan=False) + "\n")
            # A dict by hand, not asdict(): asdict deep-copies every token list (10x slower).
            f.writelines(json.dumps({k: getattr(r, k) for k in _REQUEST_FIELDS},
                                    separators=(",", ":"), allow_nan=False) + "\n"
                         for r in self.requests)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        meta: dict[str, Any] | None = None
        requests: list[TraceRequest] = []
        id_lines: dict[str, int] = {}
        for lineno, obj in _jsonl(path):
            where = f"{path}:{lineno}"
            if meta is None:
                if not (isinstance(obj, dict) and set(obj) == {"meta"}
                        and isinstance(obj["meta"], dict)):
                    raise ValueError(f"{where}: the first line must be {{\"meta\": {{...}}}}, "
                                     f"as Trace.save writes it")
                meta = obj["meta"]
                continue
            request = _request_from_dict(obj, where)
            if request.request_id in id_lines:
                raise ValueError(f"{where}: request_id {request.request_id!r} repeats line "
                                 f"{id_lines[request.request_id]}")
            id_lines[request.request_id] = lineno
            if requests and request.arrival_s < requests[-1].arrival_s:
                raise ValueError(f"{where}: arrival_s {request.arrival_s} is before the previous "
                                 f"line's {requests[-1].arrival_s}; arrivals must not decrease")
            requests.append(request)
        if meta is None:
            raise ValueError(f"{path}: empty trace file (no meta line)")
        try:
            return cls(requests=requests, meta=meta)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc

    def scaled_to_rate(self, rate: float) -> Trace:
        """The same requests with arrival offsets stretched or squeezed so that the mean rate
        (requests / last arrival) is `rate`: a rate sweep keeps the arrival pattern and prompts
        and changes only the load."""
        _check_rate(rate)
        current = self.mean_rate
        if current is None:
            raise ValueError("cannot rescale a trace whose requests all arrive at 0")
        factor = current / rate
        requests = [replace(r, arrival_s=r.arrival_s * factor,
                            prompt_token_ids=list(r.prompt_token_ids)) for r in self.requests]
        meta = {**self.meta, "rate": rate}
        meta.setdefault("scaled_from_rate", current)
        return Trace(requests=requests, meta=meta)


def _jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Yields (line number, parsed object) for each non-blank line; bad JSON names the line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {exc}") from exc


def _request_from_dict(obj: Any, where: str) -> TraceRequest:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in _REQUEST_FIELDS if k not in obj and k not in _OPTIONAL_FIELDS]
    extra = sorted(set(obj) - set(_REQUEST_FIELDS))
    if missing or extra:
        raise ValueError(f"{where}: missing fields {missing}, unknown fields {extra}")
    return TraceRequest(
        request_id=_nonempty_str(obj["request_id"], where, "request_id"),
        tier=_nonempty_str(obj["tier"], where, "tier"),
        arrival_s=_arrival(obj["arrival_s"], where),
        prompt_token_ids=_token_ids(obj["prompt_token_ids"], where, "prompt_token_ids"),
        output_tokens=_output_tokens(obj["output_tokens"], where),
        ttft_slo_ms=_slo(obj["ttft_slo_ms"], where),
        tpot_slo_ms=_slo(obj.get("tpot_slo_ms"), where, "tpot_slo_ms"),
        session=(None if obj.get("session") is None
                 else _nonempty_str(obj["session"], where, "session")))


# Field checks shared by Trace.load and load_user_trace; each names the line and the field.

def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _nonempty_str(v: Any, where: str, name: str) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError(f"{where}: field {name!r} must be a non-empty string, got {v!r}")
    return v


def _arrival(v: Any, where: str) -> float:
    if not (_is_number(v) and v >= 0):
        raise ValueError(f"{where}: field 'arrival_s' must be a number >= 0, got {v!r}")
    return float(v)


def _output_tokens(v: Any, where: str) -> int:
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise ValueError(f"{where}: field 'output_tokens' must be an integer >= 1, got {v!r}")
    return v


def _slo(v: Any, where: str, name: str = "ttft_slo_ms") -> float | None:
    if v is None:
        return None
    if not (_is_number(v) and v > 0):
        raise ValueError(f"{where}: field {name!r} must be a number > 0 or null, got {v!r}")
    return float(v)


def _token_ids(v: Any, where: str, name: str) -> list[int]:
    if not (isinstance(v, list) and v
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v)):
        shown = v if not isinstance(v, list) else f"a list of {len(v)} items"
        raise ValueError(f"{where}: field {name!r} must be a non-empty list of token ids "
                         f"(integers >= 0), got {shown!r}")
    return list(v)


def _check_rate(rate: float) -> None:
    if not (_is_number(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number of requests per second > 0, got {rate!r}")


# ---------------------------------------------------------------- prompts from the corpus


class PromptSource:
    """The corpus as one cyclic token sequence; a prompt is the window of `n` tokens starting at
    an offset. The text is tokenized paragraph by paragraph (each with its blank-line separator)
    so no single encode call exceeds a tokenizer's model_max_length warning threshold."""

    def __init__(self, tokenizer: Tokenizer, text: str | None = None) -> None:
        text = CORPUS_PATH.read_text(encoding="utf-8") if text is None else text
        paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
        if not paragraphs:
            raise ValueError("the prompt corpus is empty")
        tokens: list[int] = []
        for p in paragraphs:
            # No BOS or other special tokens: the prompt is exactly the sampled text tokens.
            tokens.extend(tokenizer.encode(p + "\n\n", add_special_tokens=False))
        self.tokens = tokens
        self.sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.tokens)

    def window(self, offset: int, n: int) -> list[int]:
        size = len(self.tokens)
        start = offset % size
        out: list[int] = []
        while len(out) < n:  # wraps around as often as needed for prompts longer than the corpus
            take = min(n - len(out), size - start)
            out.extend(self.tokens[start:start + take])
            start = 0
        return out


# ---------------------------------------------------------------- generation


def arrival_offsets(num_requests: int, rate: float, rng: np.random.Generator,
                    arrival: Arrival = "poisson", burstiness: float = 1.0) -> list[float]:
    """Cumulative arrival offsets (seconds) of `num_requests` requests at mean rate `rate`.

    Gaps are exponential (Poisson) or gamma with shape 1/burstiness and mean 1/rate, so the
    coefficient of variation of the gaps is sqrt(burstiness): burstiness > 1 is burstier than
    Poisson, < 1 smoother. (vLLM's `--burstiness` is the gamma shape itself, i.e. the inverse
    of this factor: our 2.0 is vLLM's 0.5.) As `vllm bench serve` does, the offsets are then
    rescaled so the last arrival is exactly num_requests / rate: otherwise the realised load
    differs by a few percent between seeds, which would blur paired comparisons across seeds.
    """
    _check_rate(rate)
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if arrival == "poisson":
        if burstiness != 1.0:
            raise ValueError(f"burstiness {burstiness} needs arrival='gamma'; "
                             f"Poisson arrivals have burstiness 1")
        gaps = rng.exponential(1.0 / rate, num_requests)
    elif arrival == "gamma":
        if not (_is_number(burstiness) and burstiness > 0):
            raise ValueError(f"burstiness must be a number > 0, got {burstiness!r}")
        shape = 1.0 / burstiness
        gaps = rng.gamma(shape, 1.0 / (rate * shape), num_requests)
    else:
        raise ValueError(f"arrival must be 'poisson' or 'gamma', got {arrival!r}")
    offsets = np.cumsum(gaps)
    if offsets[-1] > 0:
        offsets *= (num_requests / rate) / offsets[-1]
    return [float(x) for x in offsets]


def _apportion(shares: Sequence[float], n: int) -> list[int]:
    """Request counts per tier summing to n, as close to shares * n as integers allow (largest
    remainder). Exact counts rather than a draw per request: a 20-request smoke run of `mixed`
    then has exactly 4 urgent requests, whatever the seed."""
    raw = [s * n for s in shares]
    counts = [math.floor(x) for x in raw]
    by_remainder = sorted(range(len(raw)), key=lambda i: (counts[i] - raw[i], i))
    for i in by_remainder[:n - sum(counts)]:
        counts[i] += 1
    return counts


def generate_trace(tiers: list[TierSpec], num_requests: int, rate: float, seed: int,
                   tokenizer: Tokenizer, predict_ttft_s: Callable[[int], float],
                   arrival: Arrival = "poisson", burstiness: float = 1.0,
                   workload: str = "custom", max_prompt_len: int | None = None) -> Trace:
    """A seeded trace: the same arguments give the identical trace (ids, arrivals, tokens).

    `predict_ttft_s(n)` is the isolated TTFT of an n-token prompt (the calibrated predictor);
    `max_prompt_len` clips every sampled prompt length (a tiny test model's context)."""
    if not tiers:
        raise ValueError("a trace needs at least one tier")
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise ValueError(f"tier names must be unique, got {names}")
    total = sum(t.share for t in tiers)
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"tier shares must sum to 1, got {total} ({names})")
    if max_prompt_len is not None and max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")

    # Independent streams per concern: the same seed gives the same prompts and tier order
    # whatever the arrival process, so a poisson and a gamma trace differ only in timing.
    tier_rng, len_rng, offset_rng, arrival_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4))

    counts = _apportion([t.share for t in tiers], num_requests)
    order = [i for i, c in enumerate(counts) for _ in range(c)]
    tier_rng.shuffle(order)

    source = PromptSource(tokenizer)
    # Distinct start offsets (a permutation) so no two prompts share a first KV block until the
    # trace has more requests than the corpus has tokens; otherwise prefix caching would make
    # some prompts nearly free and skew the comparison.
    offsets = offset_rng.permutation(len(source))
    arrivals = arrival_offsets(num_requests, rate, arrival_rng, arrival, burstiness)

    # Resolved up front and without the rngs: adding a TPOT objective to a tier leaves every
    # other part of a seeded trace as it was.
    tpot_slos = [None if t.tpot_slo is None else t.tpot_slo.slo_ms(predict_ttft_s, max_prompt_len)
                 for t in tiers]
    requests: list[TraceRequest] = []
    for i, tier_index in enumerate(order):
        tier = tiers[tier_index]
        n = tier.prompt_len.sample(len_rng)
        if max_prompt_len is not None:
            n = min(n, max_prompt_len)
        requests.append(TraceRequest(
            request_id=f"{i:05d}-{tier.name}", tier=tier.name, arrival_s=arrivals[i],
            prompt_token_ids=[int(t) for t in source.window(int(offsets[i % len(offsets)]), n)],
            output_tokens=tier.output_tokens,
            ttft_slo_ms=tier.slo.slo_ms(n, predict_ttft_s), tpot_slo_ms=tpot_slos[tier_index]))

    meta = {"workload": workload, "seed": seed, "num_requests": num_requests, "rate": rate,
            "arrival": arrival, "burstiness": burstiness, "max_prompt_len": max_prompt_len,
            "tokenizer": str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__),
            "corpus_sha256": source.sha256, "tiers": [t.describe() for t in tiers]}
    return Trace(requests=requests, meta=meta)


# ---------------------------------------------------------------- the user's own requests

_USER_FIELDS = {"prompt", "output_tokens", "ttft_slo_ms", "tpot_slo_ms", "arrival_s", "tier",
                "request_id"}


def load_user_trace(path: str | Path, tokenizer: Tokenizer) -> Trace:
    """A JSONL file of the user's own requests, one per line:
    {"prompt": str | [token ids], "output_tokens": int, "ttft_slo_ms": float | null,
     "arrival_s": float, "tpot_slo_ms": float | null (optional), "tier": str (optional, default
     "user"), "request_id": str (optional)}.
    Text prompts are tokenized without special tokens. Requests are sorted by arrival (stably),
    since logs written by concurrent clients need not be in order."""
    rows: list[tuple[int, dict[str, Any]]] = []  # (line number, TraceRequest fields)
    for lineno, obj in _jsonl(path):
        where = f"{path}:{lineno}"
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - _USER_FIELDS)
        if unknown:  # a misspelt "ttft_slo_ms" must not silently mean "no SLO"
            raise ValueError(f"{where}: unknown fields {unknown}; "
                             f"allowed: {sorted(_USER_FIELDS)}")
        for name in ("prompt", "output_tokens", "arrival_s"):
            if name not in obj:
                raise ValueError(f"{where}: missing field {name!r}")
        prompt = obj["prompt"]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{where}: field 'prompt' is an empty string")
            ids = [int(t) for t in tokenizer.encode(prompt, add_special_tokens=False)]
        else:
            ids = _token_ids(prompt, where, "prompt")
        fields = {"tier": _nonempty_str(obj.get("tier", "user"), where, "tier"),
                  "arrival_s": _arrival(obj["arrival_s"], where),
                  "prompt_token_ids": ids,
                  "output_tokens": _output_tokens(obj["output_tokens"], where),
                  "ttft_slo_ms": _slo(obj.get("ttft_slo_ms"), where),
                  "tpot_slo_ms": _slo(obj.get("tpot_slo_ms"), where, "tpot_slo_ms")}
        if "request_id" in obj:
            fields["request_id"] = _nonempty_str(obj["request_id"], where, "request_id")
        rows.append((lineno, fields))
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort(key=lambda row: (row[1]["arrival_s"], row[0]))
    requests: list[TraceRequest] = []
    seen: dict[str, int] = {}
    for i, (lineno, fields) in enumerate(rows):
        rid = fields.pop("request_id", None) or f"{i:05d}-{fields['tier']}"
        if rid in seen:
            raise ValueError(f"{path}:{lineno}: request_id {rid!r} repeats line {seen[rid]}")
        seen[rid] = lineno
        requests.append(TraceRequest(request_id=rid, **fields))
    trace = Trace(requests=requests, meta={"workload": "user", "source": str(path),
                                           "num_requests": len(requests)})
    trace.meta["rate"] = trace.mean_rate
    trace.meta["tokenizer"] = str(getattr(tokenizer, "name_or_path", "")
                                  or type(tokenizer).__name__)
    return trace
