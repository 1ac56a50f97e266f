"""Step-time profiles: how long a step takes on some machine, layer by layer.

A step's time is the TTFT predictor's step model (monitor/predictor.py) with a floor, and for a
mixture of experts the expert weights its tokens read:

    max(floor_s, intercept_s + a * tokens + b * attention + d * decode_context
                 + e * E * (1 - (1 - k / E) ** tokens))

`attention` sums n * (2 * prefix + n) over the prefill chunks and `decode_context` the KV tokens
the decodes read. The last term is a mixture-of-experts model's (0 for a dense one, whose
weights the intercept reads): a step whose tokens each route to k of E experts reads the distinct
experts they touch, E * (1 - (1 - k/E) ** tokens) of them in expectation, e seconds each: k at
one decode, nearly all of them at a batch of 64 or any prefill chunk.

The floor is the host: an engine that launches ~1000 kernels a step cannot run a step faster
than it launches them, however few tokens it holds (a decode step of an 8B model on an H100
takes ~30 ms for ~5 ms of GPU work), and a longer step hides the launches behind the GPU.
Every layer takes an equal share, and a chunk that joins the pass at a later layer (a resumed
suspended chunk) counts only in the layers it runs.

Profiles ship as JSON files in engine/simulation/profiles/ (by name), or are a JSON file of
their own, or are fitted from a calibration file of any machine (`sloserve calibrate`'s output:
the same step model, no floor). A shipped profile is measured on its device, or derived from a
measured one and its model shape's parameter counts (engine/benchmarks/inputs/derived_profiles.py, `derived_from`
names the measured one) until a GPU measures it.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import msgspec

from monitor.step_time_model import StepTimeModel

_PROFILE_PACKAGE = "engine.simulation.profiles"


def expected_experts_read(num_experts: int, experts_per_token: int, tokens: float) -> float:
    """The distinct experts per layer that ``tokens`` tokens touch, each routed to
    ``experts_per_token`` of ``num_experts`` independently and uniformly, in expectation:
    E * (1 - (1 - k/E) ** tokens). 0 for a dense model (E = 0). The one formula the step profiles,
    their derivation and the throughput bounds share."""
    if not num_experts:
        return 0.0
    return num_experts * (1.0 - (1.0 - experts_per_token / num_experts) ** tokens)


class StepTimeProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    num_layers: int
    seconds_per_token: float
    # Per unit of attention work: n * (2 * prefix + n) summed over prefill chunks.
    seconds_per_attention: float = 0.0
    # Per KV token a decode reads.
    seconds_per_decode_context: float = 0.0
    intercept_s: float = 0.0
    # No step is faster than this (the host launching its kernels).
    floor_s: float = 0.0
    # From the vote that stops a pass to the executor's return: the work already queued on the
    # device finishing, and the host unwinding.
    unwind_s: float = 0.0
    # The KV pool the simulated engine gets when none is configured (GiB at `dtype`).
    kv_cache_memory_gb: float | None = None
    dtype: str = "bfloat16"
    # The model shape it times (a `sloserve bench shape` name), for tools that write a model folder.
    model_shape: str | None = None
    # A mixture of experts' weight reads: each token routes to `experts_per_token` of
    # `num_experts` experts, and reading one expert's weights in every layer takes
    # `seconds_per_expert` (0: a dense model).
    num_experts: int = 0
    experts_per_token: int = 0
    seconds_per_expert: float = 0.0
    # None where the figures were measured on the device; else the measured profile they were
    # derived from (engine/benchmarks/inputs/derived_profiles.py), until a GPU measures them.
    derived_from: str | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"profile {self.name!r}: num_layers must be >= 1")
        if self.seconds_per_token <= 0:
            raise ValueError(f"profile {self.name!r}: seconds_per_token must be > 0")
        for field in ("seconds_per_attention", "seconds_per_decode_context", "intercept_s",
                      "floor_s", "unwind_s", "seconds_per_expert"):
            if not getattr(self, field) >= 0:
                raise ValueError(f"profile {self.name!r}: {field} must be >= 0")
        if self.seconds_per_expert and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"profile {self.name!r}: seconds_per_expert needs 1 <= "
                             f"experts_per_token <= num_experts")

    def experts_read(self, tokens: float) -> float:
        """The distinct experts (per layer) a step of ``tokens`` tokens reads (0 for a dense
        model): ``expected_experts_read``."""
        return expected_experts_read(self.num_experts, self.experts_per_token, tokens)

    def compute_seconds(self, tokens: float, attention: float, decode_context: float) -> float:
        """The device's work for a step of these features, without the floor."""
        return (self.intercept_s + self.seconds_per_token * tokens
                + self.seconds_per_attention * attention
                + self.seconds_per_decode_context * decode_context
                + self.seconds_per_expert * self.experts_read(tokens))

    def step_seconds(self, tokens: int, attention: int, decode_context: int) -> float:
        """A whole step with every chunk in every layer."""
        return max(self.floor_s, self.compute_seconds(tokens, attention, decode_context))

    def layer_seconds(self, tokens: int, attention: int, decode_context: int) -> float:
        """One layer of a step whose active chunks have these features (as whole-step
        features: the layer takes its share of them)."""
        return self.step_seconds(tokens, attention, decode_context) / self.num_layers

    @classmethod
    def from_ttft_model(cls, model: StepTimeModel, num_layers: int, name: str) -> StepTimeProfile:
        """The machine a calibration file measured: its step model, with no floor beyond the
        intercept (calibration fits the sum of terms) and an unwind at the next boundary."""
        return cls(name=name, num_layers=num_layers,
                   seconds_per_token=model.seconds_per_token,
                   seconds_per_attention=model.seconds_per_token_sq,
                   seconds_per_decode_context=model.seconds_per_decode_context,
                   intercept_s=model.intercept_s,
                   floor_s=float(getattr(model, "floor_s", 0.0) or 0.0),
                   dtype="float32", description=f"fitted from the calibration file {name}")


def shipped_profiles() -> list[str]:
    """Names of the profiles that ship with sloserve."""
    files = resources.files(_PROFILE_PACKAGE).iterdir()
    return sorted(f.name.removesuffix(".json") for f in files if f.name.endswith(".json"))


def load_profile(spec: str, num_layers: int | None = None) -> StepTimeProfile:
    """A shipped profile by name, a profile JSON file, or a calibration file (`sloserve
    calibrate --output`), which needs the model's `num_layers`."""
    if spec in shipped_profiles():
        text = (resources.files(_PROFILE_PACKAGE) / f"{spec}.json").read_text()
        return _decode(text, spec)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"simulate: {spec!r} is neither a shipped profile "
                         f"({', '.join(shipped_profiles())}) nor a file")
    text = path.read_text()
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"simulate: {spec!r} is not JSON: {exc}") from exc
    if isinstance(data, dict) and "num_layers" not in data and "seconds_per_token" in data:
        if num_layers is None:
            raise ValueError(f"simulate: the calibration file {spec!r} needs the model's "
                             f"number of layers")
        return StepTimeProfile.from_ttft_model(StepTimeModel.load(path), num_layers, path.name)
    return _decode(text, spec)


def _decode(text: str, spec: str) -> StepTimeProfile:
    try:
        return msgspec.json.decode(text, type=StepTimeProfile)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"simulate: {spec!r} is not a step-time profile: {exc}") from exc
