"""Rotary position embedding: a cos/sin table built once, indexed by position once per forward.

The table holds cos and sin of the half-dimension frequencies; applying them as
``(x1*cos - x2*sin, x2*cos + x1*sin)`` is bit-for-bit HF's ``x*cos + rotate_half(x)*sin`` on the
duplicated frequencies, with half the table and no concatenated rotate.

LongRoPE (Phi-3's long-context checkpoints, Phi-4-mini) has two regimes (engine.core.long_rope):
its table holds the short factors' rows for the positions below the threshold, then the long
factors' rows for every position, from ``long_offset`` on. The model runner indexes a
long-regime request's tokens at ``position + long_offset``; nothing else reads the positions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.core.long_rope import long_rope_threshold

# Rope types served: static tables, and "longrope"'s two (one per regime). "dynamic" rescales
# with the sequence length at every step.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The config's rope settings as one dict with at least rope_theta and rope_type.

    transformers 5.x configs carry ``rope_parameters``; older ones ``rope_theta`` plus an optional
    ``rope_scaling`` dict whose type key was sometimes spelled ``type``. Families whose layer
    types rotate differently (Gemma 3: a local base for sliding layers, a scaled global one for
    the others) hold one dict per ``layer_type``.
    """
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    elif layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    else:
        params = dict(params)
    if "partial_rotary_factor" not in params and hasattr(config, "partial_rotary_factor"):
        params["partial_rotary_factor"] = config.partial_rotary_factor
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    return params


def _inv_freq(config: Any, head_dim: int, params: dict[str, Any],
              device: torch.device | str, layer_type: str | None = None
              ) -> tuple[torch.Tensor, float]:
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    factor = params.get("partial_rotary_factor", 1.0)
    if not 0 < factor <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor!r}")
    if rope_type == "default":
        # Same expression as HF's default init so the frequencies match to the last bit; a
        # partial rotary (Phi-4-mini's 0.75) turns the first int(head_dim * factor) dims only.
        base = float(params["rope_theta"])
        dim = int(head_dim * factor)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq.to(device), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if layer_type is not None:
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device,
                                                                     layer_type=layer_type)
    else:
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device)
    return inv_freq, float(attention_scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_position: int, *,
                 dtype: torch.dtype, device: torch.device | str,
                 long_inv_freq: torch.Tensor | None = None,
                 long_after: int | None = None) -> None:
        """``long_inv_freq`` and ``long_after``: LongRoPE's long factors' frequencies, and the
        length past which they apply; ``inv_freq`` then covers the positions below it."""
        super().__init__()
        self.rotary_dim = 2 * inv_freq.numel()

        def rows(frequencies: torch.Tensor, count: int) -> torch.Tensor:
            # HF computes position * inv_freq in float32, scales cos/sin, then casts to the
            # model dtype; doing it for every position up front gives the same values.
            positions = torch.arange(count, dtype=torch.float32, device=device)
            freqs = positions[:, None] * frequencies.to(device=device,
                                                         dtype=torch.float32)[None, :]
            return torch.cat((freqs.cos() * attention_scaling,
                              freqs.sin() * attention_scaling), -1)

        # Where the long regime's rows start (None: one regime).
        self.long_offset: int | None = None
        if long_inv_freq is None:
            table = rows(inv_freq, max_position)
        else:
            assert long_after is not None and long_inv_freq.shape == inv_freq.shape
            self.long_offset = min(long_after, max_position)
            table = torch.cat((rows(inv_freq, self.long_offset),
                               rows(long_inv_freq, max_position)))
        self.cos_sin: torch.Tensor
        self.register_buffer("cos_sin", table.to(dtype), persistent=False)

    @property
    def max_position(self) -> int:
        return self.cos_sin.shape[0]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the given positions, each [T, 1, rotary_dim / 2] (broadcast over heads).
        Computed once per forward pass and shared by every layer."""
        cos_sin = self.cos_sin.index_select(0, positions).unsqueeze(1)
        cos, sin = cos_sin.chunk(2, dim=-1)
        return cos, sin


def layer_rope_types(config: Any) -> list[str] | None:
    """The layer types whose rotary settings differ, per layer (Gemma 3's rope_parameters keyed
    by ``layer_types``); None where every layer rotates alike."""
    params = getattr(config, "rope_parameters", None)
    layer_types = getattr(config, "layer_types", None)
    if not isinstance(params, dict) or not layer_types:
        return None
    if not all(isinstance(params.get(kind), dict) for kind in set(layer_types)):
        return None
    return list(layer_types)


def get_rotary_embedding(config: Any, head_dim: int, *, dtype: torch.dtype,
                         device: torch.device | str,
                         layer_type: str | None = None) -> RotaryEmbedding:
    """Build the rotary table from an HF config (ValueError for unsupported rope types), for
    the layers of ``layer_type`` where the config rotates layer types differently."""
    params = rope_parameters(config, layer_type)
    if params["rope_type"] == "longrope":
        return _long_rope_embedding(config, head_dim, params, dtype, device, layer_type)
    inv_freq, attention_scaling = _inv_freq(config, head_dim, params, device, layer_type)
    if 2 * inv_freq.numel() > head_dim:
        raise ValueError(f"rotary dim {2 * inv_freq.numel()} exceeds head_dim {head_dim}")
    return RotaryEmbedding(inv_freq, attention_scaling, config.max_position_embeddings,
                           dtype=dtype, device=device)


def _long_rope_embedding(config: Any, head_dim: int, params: dict[str, Any],
                         dtype: torch.dtype, device: torch.device | str,
                         layer_type: str | None) -> RotaryEmbedding:
    """LongRoPE's table: HF's frequencies for both regimes (its init function, with and
    without a sequence past the threshold) and its attention factor."""
    if layer_type is not None:
        raise ValueError("longrope rotary set per layer type is not supported")
    threshold = long_rope_threshold(config)
    assert threshold is not None
    rotary_half = int(head_dim * params.get("partial_rotary_factor", 1.0)) // 2
    for key in ("short_factor", "long_factor"):
        factors = params.get(key)
        if not isinstance(factors, (list, tuple)) or len(factors) != rotary_half:
            count = len(factors) if isinstance(factors, (list, tuple)) else factors
            raise ValueError(f"longrope {key} must list {rotary_half} factors (one per rotary "
                             f"frequency of the {2 * rotary_half} rotary dims), got {count!r}")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    init = ROPE_INIT_FUNCTIONS["longrope"]
    short, attention_scaling = init(config, device)
    long, _ = init(config, device, seq_len=threshold + 1)
    return RotaryEmbedding(short, float(attention_scaling), config.max_position_embeddings,
                           dtype=dtype, device=device, long_inv_freq=long,
                           long_after=threshold)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by the per-token angles (cos/sin [T, 1, R/2]); returns a new tensor.
    With R < D (a partial rotary) the dims past R pass through unrotated, as HF's.

    The products are rounded separately before the add, as in HF, so bf16 results match it."""
    half = cos.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if 2 * half < x.shape[-1]:
        out[..., 2 * half:] = x[..., 2 * half:]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    out1, out2 = out[..., :half], out[..., half:2 * half]
    torch.mul(x1, cos, out=out1)
    out1.sub_(x2 * sin)
    torch.mul(x2, cos, out=out2)
    out2.add_(x1 * sin)
    return out
