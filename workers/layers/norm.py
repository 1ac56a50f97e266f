"""RMSNorm with an optional fused residual add (the vLLM calling convention)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, overload

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``norm(x)`` returns the normalized x; ``norm(x, residual)`` first adds the residual and
    returns ``(normalized, x + residual)`` so the decoder loop carries the residual stream without
    a separate add per sub-layer.

    The arithmetic follows HF's LlamaRMSNorm step for step (normalize in float32, cast back, then
    scale by the weight in the model dtype) so bf16 outputs round the same way as the reference.
    """

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        # A fused kernel with the same contract (``fused_kernel``), set by the model for its
        # backend; None runs the PyTorch arithmetic below.
        self.fused: Callable[..., Any] | None = None

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor,
                residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fused is not None:
            return self.fused(x, self.weight, self.eps, residual)
        if residual is None:
            return self._normalize(x)
        x = x + residual
        return self._normalize(x), x

    def fused_kernel(self, kernels: Any) -> Callable[..., Any] | None:
        """The backend's kernel with this norm's arithmetic (kernels.KernelBackend), or None."""
        return kernels.rms_norm

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
