"""One FP8 weight layout: how the weight is scaled (128x128 blocks, one scale per output channel,
or one per tensor), what the checkpoint calls the scale, and how a GPU quantizes activations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from workers.quantization.fp8_numerics import BLOCK

WeightStrategy = Literal["block", "channel", "tensor"]
# dynamic: per token (per 128-group for blocks) at every step; static: the checkpoint's
# input_scale; none: weight-only (W8A16), activations stay in the model dtype.
ActivationScheme = Literal["dynamic", "static", "none"]


@dataclass(frozen=True)
class Fp8Scheme:
    weight_strategy: WeightStrategy
    activations: ActivationScheme
    # The checkpoint's name of the weight scale: weight_scale_inv (the "fp8" block layout) or
    # weight_scale (compressed-tensors, and vLLM's per-tensor "fp8" checkpoints).
    scale_name: str = "weight_scale"
    # True: the checkpoint is full precision and each weight is quantized as it loads
    # (--quantization fp8); there are no scale tensors to load.
    online: bool = False
    block: tuple[int, int] = (BLOCK, BLOCK)

    def describe(self) -> str:
        weights = (f"{self.block[0]}x{self.block[1]}-block" if self.weight_strategy == "block"
                   else f"per-{self.weight_strategy}")
        return (f"FP8 {weights} weights ({self.scale_name}), activations {self.activations}"
                + (", quantized at load" if self.online else ""))
