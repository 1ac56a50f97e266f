"""Which CPU linear weights are also held in bfloat16, for the steps of few rows.

A float32 model whose weights are bfloat16 values (a bf16 checkpoint widened at load, as on
every CPU that computes in float32) reads twice the bytes it needs in a decode step.
``kernels.cpu_bf16_linear`` multiplies by a bfloat16 copy, widened in registers: the same
products at half the bytes. It wins while a step is bound by memory (few rows) and loses once it
is bound by arithmetic, so ``hold_weights_in_bf16`` measures, per weight shape, up to how many
rows it is faster than the float32 kernel the weight has (plain MKL, or what
``workers.layers.cpu_prepack`` chose when it runs first), at ``LADDER_ROWS``; steps up to that
many rows multiply by the copy, larger ones as before. Over the default model's 30 layers in
layer order on the 2-core AVX-512 machine (ms, plain MKL / oneDNN packed / bf16 copy): 1 row
15.7 / 19.1 / 9.4, 8 rows 32.8 / 24.5 / 14.4, 16 rows 35.6 / 29.5 / 24.2, 32 rows 44.3 / 39.7 /
43.6. Measured at load there, q/k/v, o and gate/up were served up to 16 rows, down up to 32 and
the LM head up to 8 (1.1 s of measuring).

The copy is held beside the float32 weight, which still serves long steps (prefill) and the
embedding a tied LM head shares: +50% of the linear weights' bytes. A weight with both a plain
and a oneDNN-packed float32 copy (``cpu_prepack``'s "both", whose plain copy only served steps
below ``packed_min_rows``) gives up its plain copy where the bf16 copy serves those rows: the
default model holds 57 MB more than with float32 weights alone.

Only weights whose every value is bfloat16 get a copy (checked bit by bit: nothing is rounded),
only in float32 models on the CPU, only for shapes of at least ``MIN_ELEMENTS`` values (the
tests' tiny models keep their float32 kernels, unmeasured). ``SLOSERVE_CPU_BF16_WEIGHTS=1``
gives every exactly-bf16 weight a copy serving up to ``FORCED_MAX_ROWS`` rows without measuring;
``=0`` gives none.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from torch import nn

from kernels import cpu_bf16_linear
from kernels.cpu_bf16_linear import Bf16Weight
from workers.layers.cpu_prepack import MIN_TUNED_ELEMENTS, linear, parameter_owners

logger = logging.getLogger(__name__)

BF16_ENV = "SLOSERVE_CPU_BF16_WEIGHTS"
MIN_ELEMENTS = MIN_TUNED_ELEMENTS
# Row counts the two kernels are timed at; a shape's copy serves up to the largest of them at
# which it (and at every smaller one) won by MARGIN.
LADDER_ROWS = (1, 8, 16, 32)
MARGIN = 0.10
# Rows the copy serves when measuring is switched off (=1).
FORCED_MAX_ROWS = 16
# Timed passes per row count (each call's fastest counts), after one untimed pass.
REPEATS = 3


def bf16_setting() -> str:
    """``SLOSERVE_CPU_BF16_WEIGHTS``: "auto" (the default: measured per shape), "1" (every
    exactly-bf16 weight, unmeasured) or "0" (none)."""
    value = os.environ.get(BF16_ENV, "auto") or "auto"
    return value if value in ("0", "1") else "auto"


def bf16_weights_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether :func:`hold_weights_in_bf16` may give weights a copy here: a float32 model on
    the CPU, the switch not off."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32
            and bf16_setting() != "0")


def hold_weights_in_bf16(model: nn.Module) -> int:
    """Give the modules that multiply through ``cpu_prepack.linear`` (``prepack_weight``) a
    bfloat16 copy of their weight where every value is bfloat16 (``bf16_weight``, serving steps
    up to ``bf16_max_rows`` rows); returns how many got one. Call after the weights are loaded
    and after ``cpu_prepack.prepack_linear_weights`` where that runs (the copy is measured
    against the kernel it chose); modules with a copy already are left alone."""
    setting = bf16_setting()
    modules = [m for m in model.modules() if getattr(m, "prepack_weight", False)
               and getattr(m, "bf16_weight", None) is None and _float32(m)]
    if setting == "auto":
        modules = [m for m in modules if m.weight.numel() >= MIN_ELEMENTS]
    # Each weight read once (a oneDNN-packed one unpacked once): checked, then packed.
    plain = {id(m): _float32_weight(m) for m in modules}
    modules = [m for m in modules if cpu_bf16_linear.is_exactly_bf16(plain[id(m)])]
    # Compiled only for a model that has such weights (~2 s the first time on a machine).
    if not modules or not cpu_bf16_linear.warm_up():
        return 0
    copies = {id(m): cpu_bf16_linear.pack(plain.pop(id(m))) for m in modules}
    plain.clear()
    shapes = {_shape(m) for m in modules}
    if setting == "1":
        max_rows = dict.fromkeys(shapes, FORCED_MAX_ROWS)
        timings: dict[tuple[int, int], list[tuple[int, float]]] = {}
    else:
        max_rows, timings = _measure(modules, copies)
    owners = parameter_owners(model)
    held = 0
    freed = 0
    for module in modules:
        rows = max_rows[_shape(module)]
        if not rows:
            continue
        module.bf16_weight = copies[id(module)]
        module.bf16_max_rows = rows
        held += 1
        freed += _drop_unused_plain_copy(module, owners)
    by_shape = []
    for shape in sorted(shapes):
        ratios = ", ".join(f"{r} rows {t:.2f}" for r, t in timings.get(shape, []))
        serves = f"up to {max_rows[shape]} rows" if max_rows[shape] else "not used"
        by_shape.append(f"{shape[0]}x{shape[1]}: {serves}" + (f" (bf16/float32 time {ratios})"
                                                               if ratios else ""))
    extra = sum(m.bf16_weight.nbytes for m in modules if m.bf16_weight is not None) - freed
    logger.info("CPU bfloat16 weight copies (%+.0f MB): %s", extra / 1e6, "; ".join(by_shape))
    return held


def _float32(module: nn.Module) -> bool:
    return module.weight.dtype == torch.float32


def _float32_weight(module: nn.Module) -> torch.Tensor:
    """The weight as a plain [N, K] tensor (a oneDNN-packed one unpacked: the same values)."""
    weight = module.weight.detach()
    return weight.to_dense() if weight.is_mkldnn else weight


def _shape(module: nn.Module) -> tuple[int, int]:
    return tuple(module.weight.shape)  # type: ignore[return-value]


def _drop_unused_plain_copy(module: nn.Module, owners: dict[int, int]) -> int:
    """A "both" weight whose plain copy only served the rows the bf16 copy now serves keeps its
    packed copy alone (unless the plain tensor is shared: a tied LM head's embedding). Returns
    the bytes freed."""
    packed = getattr(module, "packed_weight", None)
    if packed is None or module.packed_min_rows > module.bf16_max_rows + 1:
        return 0
    plain = module.weight
    shared = owners.get(id(plain), 0) > 1
    module.packed_weight = None
    module.packed_min_rows = 0
    module.linear_kernel = "packed"
    module.weight = nn.Parameter(packed, requires_grad=False)
    return 0 if shared else plain.numel() * plain.element_size()


def rows_served(measured: list[tuple[int, float]]) -> int:
    """The rows a copy serves from its (rows, bf16 / float32 time) at each ladder row count:
    up to the last count of the leading run that it won by MARGIN; 0 where it lost one row."""
    served = 0
    for rows, ratio in measured:
        if ratio * (1 + MARGIN) > 1:
            break
        served = rows
    return served


def _measure(modules: list[nn.Module], copies: dict[int, Bf16Weight]
             ) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], list[tuple[int, float]]]]:
    """Per shape, the rows the copy serves and its time over the float32 kernel's at each
    ladder row count (sums of each call's fastest time; weights in model order, as a step reads
    them, each through one kernel and then the other, alternating which goes first)."""
    started = time.perf_counter()
    clock = time.perf_counter
    ratios: dict[tuple[int, int], list[tuple[int, float]]] = {}
    with torch.inference_mode():
        for rows in LADDER_ROWS:
            inputs = {k: torch.randn(rows, k) for k in {_shape(m)[1] for m in modules}}
            best = [[float("inf"), float("inf")] for _ in modules]
            for repeat in range(REPEATS + 1):
                for module, times in zip(modules, best):
                    x = inputs[_shape(module)[1]]
                    calls = ((0, linear, (x, module.weight, None, module.packed_weight,
                                          module.packed_min_rows)),
                             (1, cpu_bf16_linear.linear, (x, copies[id(module)])))
                    for kernel, run, args in calls if repeat % 2 else calls[::-1]:
                        began = clock()
                        run(*args)
                        if repeat:
                            times[kernel] = min(times[kernel], clock() - began)
            for shape in {_shape(m) for m in modules}:
                pairs = [t for m, t in zip(modules, best) if _shape(m) == shape]
                ratio = sum(t[1] for t in pairs) / sum(t[0] for t in pairs)
                ratios.setdefault(shape, []).append((rows, ratio))
    max_rows = {shape: rows_served(measured) for shape, measured in ratios.items()}
    logger.info("CPU bfloat16 weight copies measured in %.2f s", time.perf_counter() - started)
    return max_rows, ratios
