"""Step-time profiles derived, not measured: a model shape's profile on a device from the limits a
measured profile shows and the shape's parameter counts, until a GPU measures it.

    python -m engine.benchmarks.inputs.derived_profiles          # rewrites the derived profiles
    python -m engine.benchmarks.inputs.derived_profiles --check  # exit 1 where one differs

The measured profile (h100-llama-3.1-8b: Llama-3.1-8B, bf16, one H100, eager) gives the
device's limits, each one of its fitted terms divided into the work that term does:

- weight reads: the intercept reads the step's weights once (every layer's linear weights and
  the LM head; the embedding is a lookup): bytes / intercept_s. (15.0 GB / 4 ms = 3.75 TB/s, above
  the H100 SXM datasheet's 3.35 TB/s: the fitted intercept comes from prefill steps, where the
  reads overlap the GEMMs, so the decode figures derived from it are optimistic by 10-35%;
  eager decode steps sit at the floor anyway.)
- GEMMs: seconds_per_token is a token's linear-layer FLOPs, 2 x its layers' linear parameters
  (the LM head runs for sampled rows only): 14.0 GFLOP / 30 us = 465 TFLOP/s (47% of the bf16
  peak). Norms, activations and the rest count in it, as in the measured fit.
- attention: a unit of n * (2 * prefix + n) is 2 * layers * heads * head_dim FLOPs
  (QK^T and PV, causal): 316 TFLOP/s.
- KV reads: a decode's context token is 2 * layers * kv_heads * head_dim * 2 bytes: 2.6 TB/s.
- the floor (the host launching the step's kernels) is per layer: floor_s / num_layers.
- the unwind is the same on every shape; the KV pool is what the measured one leaves of
  DEFAULT_GPU_MEMORY_UTILIZATION x the device's memory once weights and the rest are in.

A derived profile spends them on its shape's work:

    intercept_s        = dense weight bytes / weight bytes per s
    seconds_per_token  = 2 * active linear params per token / GEMM FLOP/s (x fp8 speedup)
    seconds_per_expert = one expert's bytes in every MoE layer / weight bytes per s
    seconds_per_attention, seconds_per_decode_context, floor_s: the shape's own work likewise

where dense weights are the attention projections, the routers, any dense MLP and the LM head, and
the active linear params of a token are those plus its top-k experts'. A mixture of experts'
decode step at batch b reads E * (1 - (1 - k/E) ** b) experts per layer (the profile's expert
term, engine/simulation/profile.py): k at batch 1, so Qwen3-30B-A3B reads 6.1 GB against the
8B's 15 GB; nearly all at batch 64, 59 GB. Assumptions, each worth a GPU's measurement:

- routing is uniform and independent across tokens (real routers are skewed: fewer distinct
  experts at a batch, so the expert term is an upper bound);
- a grouped expert GEMM runs at the dense GEMM rate (fused MoE kernels reach less with few tokens
  per expert);
- an MoE layer launches about as many kernels as a dense layer (a fused MoE kernel; a loop over
  experts launches far more, and the floor grows with it);
- FP8 (block-wise e4m3, 1 byte a weight plus a float32 scale per 128x128 block) halves the
  linear weights' bytes and runs its GEMMs at FP8_GEMM_SPEEDUP x the bf16 rate: 2, the H100's FP8
  tensor-core peak over its bf16 one, an upper bound (block-scaled kernels gain less); the LM
  head, embedding, attention and KV cache stay bf16, and the floor ignores the activation
  quantization's extra kernels;
- the H200 is the H100 (the same GH100 compute and, assumed, the same host) with the datasheet
  HBM bandwidth (4.8 against 3.35 TB/s) for weight and KV reads, and 141 GB.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec

from engine.simulation.profile import StepTimeProfile, expected_experts_read, load_profile

GIB = 2**30
# The FP8 GEMM rate over the bf16 one (the H100's tensor-core peaks, 1979 / 989 TFLOP/s dense):
# an upper bound for block-scaled FP8 kernels.
FP8_GEMM_SPEEDUP = 2.0
# One float32 scale per 128x128 block beside each e4m3 byte.
_FP8_BYTES_PER_WEIGHT = 1 + 4 / (128 * 128)
# torch.cuda total_memory of an H100 80GB SXM and an H200 141GB, GiB.
_MEMORY_GIB = {"h100": 79.2, "h200": 139.8}
# Datasheet HBM bandwidth, GB/s (bench/kernels/harness.py DATASHEET_GBPS).
DATASHEET_GBPS = {"h100": 3350.0, "h200": 4800.0}
MEASURED = "h100-llama-3.1-8b"

# Derived profiles that ship: name -> (model shape, device). Mixtral's bf16 weights (87 GiB) do
# not fit an H100: its profile is an H200's.
DERIVED: dict[str, tuple[str, str]] = {
    "h100-qwen3-30b-a3b": ("qwen3-30b-a3b", "h100"),
    "h100-llama-3.1-8b-fp8": ("llama-3.1-8b-fp8", "h100"),
    "h200-mixtral-8x7b": ("mixtral-8x7b", "h200"),
}


@dataclass(frozen=True)
class ShapeWork:
    """What one forward pass of a model shape reads and computes (parameters, bytes, FLOPs)."""

    num_layers: int
    # Linear parameters every token uses in all layers: attention projections, routers, dense MLPs.
    dense_linear_params: int
    # One expert's parameters summed over the MoE layers; each token uses experts_per_token.
    expert_params: int
    num_experts: int
    experts_per_token: int
    lm_head_params: int
    embedding_params: int  # 0 where tied to the LM head
    norm_params: int
    linear_bytes_per_weight: float  # 2 for bf16, ~1 for FP8
    fp8: bool
    attention_flops_per_unit: float  # per unit of n * (2 * prefix + n)
    kv_bytes_per_token: float  # a token's keys and values in every layer

    @property
    def active_linear_params(self) -> int:
        """A token's linear parameters in the layers (the LM head apart)."""
        return self.dense_linear_params + self.experts_per_token * self.expert_params

    @property
    def active_params(self) -> int:
        """The published "active parameters": a token's layers, embedding row and LM head."""
        return (self.active_linear_params + self.lm_head_params + self.embedding_params
                + self.norm_params)

    @property
    def total_params(self) -> int:
        return (self.dense_linear_params + self.num_experts * self.expert_params
                + self.lm_head_params + self.embedding_params + self.norm_params)

    @property
    def dense_bytes_read(self) -> float:
        """What every step reads whatever its tokens: the non-expert linear weights and the LM
        head (bf16)."""
        return self.dense_linear_params * self.linear_bytes_per_weight + 2 * self.lm_head_params

    @property
    def expert_bytes(self) -> float:
        return self.expert_params * self.linear_bytes_per_weight

    @property
    def weight_bytes(self) -> float:
        """The whole checkpoint in device memory."""
        linear = self.dense_linear_params + self.num_experts * self.expert_params
        return (linear * self.linear_bytes_per_weight
                + 2 * (self.lm_head_params + self.embedding_params + self.norm_params))

    def bytes_read(self, tokens: float) -> float:
        """A step's weight reads: the dense weights and the experts its tokens touch."""
        return self.dense_bytes_read + expected_experts_read(
            self.num_experts, self.experts_per_token, tokens) * self.expert_bytes


def shape_work(config: dict[str, Any]) -> ShapeWork:
    """A model shape's work from its config.json fields (engine/benchmarks/inputs/model_shapes.py
    SHAPES): dense Llama/Qwen/Mistral, Mixtral (num_local_experts) and Qwen-MoE (num_experts,
    moe_intermediate_size, decoder_sparse_step, mlp_only_layers)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o; k, v
    num_experts = config.get("num_local_experts") or config.get("num_experts") or 0
    k = config.get("num_experts_per_tok", 0) if num_experts else 0
    expert_size = config.get("moe_intermediate_size") or config["intermediate_size"]
    step = config.get("decoder_sparse_step", 1) or 1
    dense_only = set(config.get("mlp_only_layers", []))
    moe_layers = (0 if not num_experts else
                  sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0))
    dense_mlp = 3 * hidden * config["intermediate_size"]  # gate, up, down
    dense_linear = (layers * attention + (layers - moe_layers) * dense_mlp
                    + moe_layers * hidden * num_experts)  # the routers
    vocab = config["vocab_size"]
    fp8 = (config.get("quantization_config") or {}).get("quant_method") == "fp8"
    return ShapeWork(
        num_layers=layers, dense_linear_params=dense_linear,
        expert_params=moe_layers * 3 * hidden * expert_size,
        num_experts=num_experts, experts_per_token=k, lm_head_params=vocab * hidden,
        embedding_params=0 if config.get("tie_word_embeddings") else vocab * hidden,
        norm_params=(2 * layers + 1) * hidden,
        linear_bytes_per_weight=_FP8_BYTES_PER_WEIGHT if fp8 else 2.0, fp8=fp8,
        attention_flops_per_unit=2.0 * layers * heads * head_dim,
        kv_bytes_per_token=2.0 * layers * kv_heads * head_dim * 2)


@dataclass(frozen=True)
class DeviceLimits:
    """A device's rates as a measured profile shows them (see the module's docstring)."""

    device: str
    source: str  # the measured profile
    memory_gib: float
    weight_bytes_per_s: float
    gemm_flops_per_s: float
    attention_flops_per_s: float
    kv_bytes_per_s: float
    floor_s_per_layer: float
    unwind_s: float
    # Memory neither weights nor KV take within the utilized share (activations, workspace).
    other_gib: float
    # How the limits were had, where not as measured.
    note: str = ""


def measured_limits(profile: StepTimeProfile, memory_gib: float, device: str) -> DeviceLimits:
    """The limits ``profile`` (measured, naming its model shape) shows on a device of
    ``memory_gib``."""
    from engine.benchmarks.inputs.model_shapes import SHAPES
    from engine.config import DEFAULT_GPU_MEMORY_UTILIZATION

    if profile.model_shape is None or profile.derived_from is not None:
        raise ValueError(f"{profile.name!r} is not a measured profile of a named shape")
    work = shape_work(SHAPES[profile.model_shape])
    if work.num_experts or work.fp8:
        raise ValueError(f"{profile.name!r}: derive from a dense bf16 model's profile")
    other_gib = (memory_gib * DEFAULT_GPU_MEMORY_UTILIZATION - work.weight_bytes / GIB
                 - (profile.kv_cache_memory_gb or 0.0))
    return DeviceLimits(
        device=device, source=profile.name, memory_gib=memory_gib,
        weight_bytes_per_s=work.dense_bytes_read / profile.intercept_s,
        gemm_flops_per_s=2 * work.active_linear_params / profile.seconds_per_token,
        attention_flops_per_s=work.attention_flops_per_unit / profile.seconds_per_attention,
        kv_bytes_per_s=work.kv_bytes_per_token / profile.seconds_per_decode_context,
        floor_s_per_layer=profile.floor_s / profile.num_layers, unwind_s=profile.unwind_s,
        other_gib=other_gib)


def device_limits(device: str) -> DeviceLimits:
    """``h100``: measured (the h100-llama-3.1-8b profile); ``h200``: the H100's with the
    datasheet HBM bandwidth and memory."""
    h100 = measured_limits(load_profile(MEASURED), _MEMORY_GIB["h100"], "h100")
    if device == "h100":
        return h100
    if device == "h200":
        ratio = DATASHEET_GBPS["h200"] / DATASHEET_GBPS["h100"]
        return DeviceLimits(**{**h100.__dict__, "device": "h200",
                               "memory_gib": _MEMORY_GIB["h200"],
                               "weight_bytes_per_s": h100.weight_bytes_per_s * ratio,
                               "kv_bytes_per_s": h100.kv_bytes_per_s * ratio,
                               "note": f"the H100's with reads x{ratio:.3g} (datasheet HBM "
                                       f"bandwidth) and {_MEMORY_GIB['h200']:g} GiB"})
    raise ValueError(f"no limits for device {device!r}; known: {', '.join(_MEMORY_GIB)}")


def _round(x: float) -> float:
    return float(f"{x:.4g}")


def derive_profile(shape: str, limits: DeviceLimits, name: str | None = None,
                   require_fit: bool = True) -> StepTimeProfile:
    """``shape``'s profile on the device ``limits`` describe (figures to 4 significant digits).
    A shape whose weights leave no KV pool is refused unless ``require_fit`` is False (then the
    profile names no pool: for comparing step times only)."""
    from engine.benchmarks.inputs.model_shapes import SHAPES
    from engine.config import DEFAULT_GPU_MEMORY_UTILIZATION

    work = shape_work(SHAPES[shape])
    name = name or f"{limits.device}-{shape}"
    kv_gib = (limits.memory_gib * DEFAULT_GPU_MEMORY_UTILIZATION - work.weight_bytes / GIB
              - limits.other_gib)
    if kv_gib <= 0 and require_fit:
        raise ValueError(f"{shape}'s weights ({work.weight_bytes / GIB:.1f} GiB) leave no KV pool "
                         f"on a {limits.device} ({limits.memory_gib:g} GiB)")
    gemm = limits.gemm_flops_per_s * (FP8_GEMM_SPEEDUP if work.fp8 else 1.0)
    per_token = 2 * work.active_linear_params / gemm
    moe = ""
    if work.num_experts:
        moe = (f"; {work.num_experts} experts, {work.experts_per_token} per token, "
               f"{work.expert_bytes / 1e9:.3g} GB an expert in all layers: a step reads "
               f"E*(1-(1-k/E)^tokens) of them")
    fp8 = (f"; FP8 weights (1 byte + block scales), GEMMs at {FP8_GEMM_SPEEDUP:g}x the bf16 "
           f"rate (assumed)" if work.fp8 else "")
    description = (
        f"DERIVED, not measured (engine/benchmarks/inputs/derived_profiles.py; until a GPU "
        f"measures it): the "
        f"{shape} shape on one {limits.device.upper()}, from {limits.source}'s measured limits "
        f"(weights read at {limits.weight_bytes_per_s / 1e12:.3g} TB/s, GEMMs at "
        f"{limits.gemm_flops_per_s / 1e12:.3g} TFLOP/s, attention at "
        f"{limits.attention_flops_per_s / 1e12:.3g} TFLOP/s, KV read at "
        f"{limits.kv_bytes_per_s / 1e12:.3g} TB/s, a floor of "
        f"{limits.floor_s_per_layer * 1e3:.3g} ms a layer"
        f"{': ' + limits.note if limits.note else ''}) and the shape's counts: "
        f"{work.total_params / 1e9:.3g}B parameters, {work.active_params / 1e9:.3g}B active a "
        f"token, {work.dense_bytes_read / 1e9:.3g} GB read every step{moe}{fp8}.")
    return StepTimeProfile(
        name=name, num_layers=work.num_layers,
        seconds_per_token=_round(per_token),
        seconds_per_attention=_round(work.attention_flops_per_unit
                                     / limits.attention_flops_per_s),
        seconds_per_decode_context=_round(work.kv_bytes_per_token / limits.kv_bytes_per_s),
        intercept_s=_round(work.dense_bytes_read / limits.weight_bytes_per_s),
        floor_s=_round(limits.floor_s_per_layer * work.num_layers),
        unwind_s=limits.unwind_s,
        kv_cache_memory_gb=round(kv_gib, 1) if kv_gib > 0 else None,
        dtype="bfloat16", model_shape=shape,
        num_experts=work.num_experts, experts_per_token=work.experts_per_token,
        seconds_per_expert=_round(work.expert_bytes / limits.weight_bytes_per_s)
        if work.num_experts else 0.0,
        derived_from=limits.source, description=description)


def derived_profiles() -> dict[str, StepTimeProfile]:
    """The derived profiles that ship, as the generator computes them now."""
    return {name: derive_profile(shape, device_limits(device), name)
            for name, (shape, device) in DERIVED.items()}


def profile_json(profile: StepTimeProfile) -> str:
    return json.dumps(msgspec.to_builtins(profile), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 where a shipped profile differs")
    parser.add_argument("--folder", default=None,
                        help="where to write (default: engine/simulation/profiles/)")
    args = parser.parse_args(argv)
    folder = Path(args.folder or str(resources.files("engine.simulation.profiles")))
    stale = []
    for name, profile in derived_profiles().items():
        path = folder / f"{name}.json"
        text = profile_json(profile)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(path)
    if stale:
        print(f"stale: {', '.join(stale)} (python -m engine.benchmarks.inputs.derived_profiles)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
