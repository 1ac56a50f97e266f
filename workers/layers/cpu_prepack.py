"""oneDNN weight prepacking for the linear layers on a CPU.

``F.linear`` on a CPU hands each matmul to MKL, which repacks the weight into its blocked layout on
every call: for the few rows of a decode step that repacking is most of the work. oneDNN can pack a
weight once, at load time, into the layout its kernels read, and then multiply by it directly.
Measured on an AVX2 machine over the default model's 30 layers of GEMMs (weights read from DRAM,
as in a real step; ``bench/diagnostics/cpu_linear.py``): 16 rows 105 -> 57 ms, 64 rows 203 -> 149 ms, 512 rows
891 -> 810 ms, one row 47 -> 35 ms; the 49152-row LM head at 16 rows 27 -> 11 ms.

The packed tensor replaces the layer's ``weight`` parameter (same shape; ``is_mkldnn`` is true) and
:func:`linear` dispatches on that, so a layer that was not packed (another device, another dtype,
``SLOSERVE_CPU_PREPACK=0``) runs ``F.linear`` as before. Only float32 is packed: it is the dtype a
CPU without native bf16 runs, and the only one measured. Results differ from ``F.linear`` by float
rounding (another summation order), not more.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

PREPACK_ENV = "SLOSERVE_CPU_PREPACK"
# The row count oneDNN is told to expect when it picks the packed layout. 16 measured as fast as
# the best hint at every row count from 1 to 512, while a one-row hint made 16-row GEMMs slower
# than no packing at all.
PACK_ROWS_HINT = 16


def prepack_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether :func:`prepack_linear_weights` packs anything for this device and dtype."""
    if os.environ.get(PREPACK_ENV, "1") == "0":
        return False
    return (torch.device(device).type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for a plain or a prepacked weight."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def prepack_linear_weights(model: nn.Module) -> int:
    """Replace the weight of every module that multiplies through :func:`linear` (those with
    ``prepack_weight = True``) by its oneDNN-packed copy; returns how many were packed.

    A weight shared with another module (a tied LM head shares the embedding's) is copied, not
    replaced: the embedding still looks rows up in the plain tensor. Call after the weights are
    loaded; the plain weight of an unshared layer is freed.
    """
    modules = [m for m in model.modules() if getattr(m, "prepack_weight", False)]
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    packed = 0
    for module in modules:
        weight = module.weight
        # Packed already; or not float32 (an FP8 layer's weight is float8_e4m3fn and multiplied
        # by its quant method, which sets prepack_weight False; checked here too).
        if weight.is_mkldnn or weight.dtype != torch.float32:
            continue
        shared = owners.get(id(weight), 0) > 1
        packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
        module.weight = nn.Parameter(packed_weight, requires_grad=False)
        packed += 1
        if shared:
            logger.info("%s: weight shared with another module; the packed copy adds %.0f MB",
                        type(module).__name__, weight.numel() * weight.element_size() / 1e6)
    return packed
