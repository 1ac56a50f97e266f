"""SwiGLU's activation: ``silu(gate) * up`` over the merged gate_up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] of shape [..., 2 * I] -> ``F.silu(gate) * up`` [..., I] in x's dtype.

    HF's LlamaMLP computes ``act_fn(gate_proj(x)) * up_proj(x)``: silu rounded to the model dtype,
    then the product rounded again; this is the same two ops, so bf16 results match it. A fused
    kernel with this contract (kernels.KernelBackend.silu_and_mul) replaces it on Triton, and
    in float32 models on a CPU (kernels.cpu_fused: bit for bit these two ops)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] [..., 2 * I] -> ``gelu_tanh(gate) * up`` [..., I]: GeGLU with the tanh
    approximation (HF's ``gelu_pytorch_tanh``, Gemma's), rounded as HF's two ops are."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
