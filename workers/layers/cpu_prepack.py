"""The CPU linear layers' kernel: MKL on the plain weight, oneDNN on a prepacked copy, or both
by row count, chosen by measuring the two on the model's own weights at load.

``F.linear`` on a CPU hands each matmul to MKL, which reads the weight in its plain layout.
oneDNN can pack a weight once, at load time, into the blocked layout its kernels read, and then
multiply by it directly. Which is faster depends on the machine, the weight's shape and the row
count, and not by a little:

- On an AVX2 machine (the model's 30 layers of GEMMs, weights read from DRAM as in a real step;
  ``bench/diagnostics/cpu_linear.py``), oneDNN won everywhere: 16 rows 105 -> 57 ms, 64 rows
  203 -> 149 ms, 512 rows 891 -> 810 ms, one row 47 -> 35 ms; the 49152-row LM head at 16 rows
  27 -> 11 ms.
- On the 2-core AVX-512 machine (no AMX), each of the default model's shapes over its 30 layers
  (ms, plain MKL / packed oneDNN): q/k/v 960x576 2.35/3.61 at 1 row, 4.25/4.46 at 8, 56.8/54.5
  at 512; o 576x576 1.13/1.86 at 1, 2.15/2.59 at 8, 32.3/32.2 at 512; down 576x1536 3.75/5.91
  at 1, 6.32/7.81 at 8, 84.8/82.9 at 512; gate/up 3072x576 7.96/10.46 at 1, 11.5/12.4 at 2,
  10.9/12.2 at 3, 17.6/12.7 at 4, 19.7/13.5 at 8, 167.7/166.3 at 512. A whole one-row decode
  forward took 27.7 ms with every weight plain against 37.5 ms with every weight packed, at 8
  rows 64.9 against 61.0.

So ``prepack_linear_weights`` asks the machine two questions, each answered by plain time /
packed time over the model's weights (each call's fastest over a few passes: see
``_time_kernels`` for why):

1. At one row, over every weight: does plain win by ``MARGIN``? (On the AVX-512 machine the
   ratio read 0.75-0.82 on every quiet start: yes; on the AVX2 machine, no.)
2. At ``BATCH_ROWS`` rows, per weight shape: does packed win by ``BATCH_MARGIN``? (AVX-512:
   gate/up 1.52-1.68 and the LM head 2.2-2.8, yes; q/k/v 0.97-1.07, o 0.85-0.93, down
   0.84-0.93, no.)

Where plain does not win single rows, every weight is packed, as before this measurement
existed. Where it does, a shape that packing speeds up at ``BATCH_ROWS`` keeps both: the plain
weight for steps below ``PACKED_MIN_ROWS`` rows, the packed copy from there on (``both``: the
shape's weights held twice, +212 MB for the default model's gate/up; nothing for a tied LM head,
whose plain weight is the embedding's); any other shape stays plain only (``plain``: no packed
copy at all). In the engine (``bench/results/HISTORY.md``, "CPU decode: compiled glue between
attention ops"), this alone took a one-sequence decode step over 512 tokens from 43.1 to 34.3
ms and an eight-sequence one from 72.3 to 69.4 ms, outputs unchanged. Finer questions (the
crossover row count of each shape, q/k/v's 5-10% either way) were tried and gave other answers
from one start to the next on a machine shared with other processes; these two came out the
same on every start that was not disturbed, and a disturbed measurement is repeated
(``_measure``). Measuring takes ~0.7 s for the default model on a quiet machine, at most
``TUNE_BUDGET_S`` (plus one measurement) on a busy one.

Weights smaller than ``MIN_TUNED_ELEMENTS`` (the tests' tiny models) are packed without a
measurement, so their numerics do not depend on the machine's load; ``SLOSERVE_CPU_PREPACK=1``
packs every weight that way, and ``=0`` packs none. Only float32 is packed: it is the dtype a
CPU without native bf16 runs, and the only one measured. The kernels differ by float rounding
(another summation order), not more.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_bf16_linear
from kernels.cpu_bf16_linear import Bf16Weight

logger = logging.getLogger(__name__)

PREPACK_ENV = "SLOSERVE_CPU_PREPACK"
# The row count oneDNN is told to expect when it picks the packed layout. 16 measured as fast as
# the best hint at every row count from 1 to 512, while a one-row hint made 16-row GEMMs slower
# than no packing at all.
PACK_ROWS_HINT = 16
# Weights with fewer elements are packed without measuring (the default model's smallest,
# 576 x 576, is above it; a tiny test model's are far below).
MIN_TUNED_ELEMENTS = 300_000
# The batched row count of question 2, and the row count from which a weight with both
# kernels multiplies by its packed copy (gate/up at 3 rows: a tie; at 4: packed 1.4x faster).
BATCH_ROWS = 8
PACKED_MIN_ROWS = 3
# How much faster (as a share of the slower time) a kernel must be to count as winning.
MARGIN = 0.10
BATCH_MARGIN = 0.15
# Timed passes per row count (each call's fastest counts), after one untimed pass that warms
# oneDNN's primitive cache up.
TUNE_REPEATS = 4
# Measurements made at most (within TUNE_BUDGET_S), while one was disturbed (it took BUSY times
# what its calls' fastest times add up to) or its one-row ratio is within MARGIN of a tie.
TUNE_ATTEMPTS = 3
TUNE_BUDGET_S = 10.0
BUSY = 2.0

PLAIN, PACKED, BOTH = "plain", "packed", "both"


def prepack_setting() -> str:
    """``SLOSERVE_CPU_PREPACK``: "auto" (the default: measured per weight shape), "1" (pack
    every weight) or "0" (pack none)."""
    value = os.environ.get(PREPACK_ENV, "auto") or "auto"
    return value if value in ("0", "1") else "auto"


def prepack_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether :func:`prepack_linear_weights` packs anything for this device and dtype."""
    if prepack_setting() == "0":
        return False
    return (torch.device(device).type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _mkl_linear(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None = None, packed_min_rows: int = 0,
           bf16: Bf16Weight | None = None, bf16_max_rows: int = 0) -> torch.Tensor:
    """``F.linear`` for a plain or a prepacked ``weight``; with ``packed`` (the same weight
    packed, kernel ``both``), inputs of ``packed_min_rows`` rows or more multiply by that; with
    ``bf16`` (its bfloat16 copy, ``workers.layers.cpu_bf16_weights``), inputs of up to
    ``bf16_max_rows`` rows multiply by that."""
    if bf16 is not None and x.numel() <= bf16_max_rows * x.shape[-1]:
        return cpu_bf16_linear.linear(x, bf16, bias)
    if packed is not None and x.numel() >= packed_min_rows * x.shape[-1]:
        return _onednn_linear(x, packed, bias)
    if weight.is_mkldnn:
        return _onednn_linear(x, weight, bias)
    return _mkl_linear(x, weight, bias)


@dataclass(frozen=True)
class KernelChoice:
    """One weight shape's kernel, and the plain / packed time ratios it was chosen by: at one
    row over every measured weight (the machine's answer, question 1) and at ``BATCH_ROWS`` over
    this shape's weights (question 2); None where nothing was measured."""

    shape: tuple[int, int]
    kernel: str
    packed_min_rows: int = 0
    one_row_ratio: float | None = None
    batch_ratio: float | None = None

    def describe(self, modules: int, extra_bytes: int) -> str:
        rows = f" from {self.packed_min_rows} rows" if self.kernel == BOTH else ""
        extra = f", +{extra_bytes / 1e6:.0f} MB" if extra_bytes else ""
        timed = ""
        if self.batch_ratio is not None:
            timed = f" (plain/packed time at {BATCH_ROWS} rows {self.batch_ratio:.2f})"
        return f"{self.shape[0]}x{self.shape[1]} x{modules}: {self.kernel}{rows}{extra}{timed}"


def choose_kernel(shape: tuple[int, int], one_row_ratio: float,
                  batch_ratio: float) -> KernelChoice:
    """The kernel for a shape from the two plain / packed time ratios (module docstring)."""
    measured = dict(one_row_ratio=one_row_ratio, batch_ratio=batch_ratio)
    if one_row_ratio >= 1 - MARGIN:
        return KernelChoice(shape, PACKED, **measured)
    if batch_ratio * (1 - BATCH_MARGIN) > 1:
        return KernelChoice(shape, BOTH, PACKED_MIN_ROWS, **measured)
    return KernelChoice(shape, PLAIN, **measured)


def prepack_linear_weights(model: nn.Module, measure: bool | None = None) -> int:
    """Give every module that multiplies through :func:`linear` (those with
    ``prepack_weight = True``) its kernel by weight shape (``linear_kernel``, and for ``both``
    ``packed_weight`` and ``packed_min_rows``); returns how many modules got a packed weight.
    Modules that have a kernel already are left alone: calling twice changes nothing.

    ``measure`` None follows ``SLOSERVE_CPU_PREPACK`` (measured unless it is "1"); weights below
    ``MIN_TUNED_ELEMENTS`` are packed unmeasured either way. A packed weight shared with another
    module (a tied LM head shares the embedding's) is a copy: the embedding still looks rows up
    in the plain tensor. Call after the weights are loaded.
    """
    if measure is None:
        measure = prepack_setting() != "1"
    modules = [m for m in model.modules() if getattr(m, "prepack_weight", False)
               and getattr(m, "linear_kernel", None) is None]
    # Packed already; or not float32 (an FP8 layer's weight is float8_e4m3fn and multiplied by
    # its quant method, which sets prepack_weight False; checked here too).
    modules = [m for m in modules if not m.weight.is_mkldnn and m.weight.dtype == torch.float32]
    if not modules:
        return 0
    packed = {id(m): torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), PACK_ROWS_HINT)
              for m in modules}
    tuned = [m for m in modules if measure and m.weight.numel() >= MIN_TUNED_ELEMENTS]
    choices: dict[tuple[int, int], KernelChoice] = {}
    if tuned:
        one_row, batch = _measure(tuned, packed)
        choices = {shape: choose_kernel(shape, one_row, ratio) for shape, ratio in batch.items()}
    owners = parameter_owners(model)
    extra: dict[tuple[int, int], int] = {}
    counts: dict[tuple[int, int], int] = {}
    for module in modules:
        shape = _shape(module)
        choice = choices.setdefault(shape, KernelChoice(shape, PACKED))
        extra[shape] = extra.get(shape, 0) + _apply(module, choice, packed.pop(id(module)),
                                                    owners)
        counts[shape] = counts.get(shape, 0) + 1
    # "+N MB": what the packed copies add to holding the plain weights alone.
    logger.info("CPU linear kernels by weight shape: %s", "; ".join(
        choices[s].describe(counts[s], extra[s]) for s in counts))
    return sum(m.linear_kernel != PLAIN for m in modules)


def _shape(module: nn.Module) -> tuple[int, int]:
    return tuple(module.weight.shape)  # type: ignore[return-value]


def parameter_owners(model: nn.Module) -> dict[int, int]:
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return owners


def _apply(module: nn.Module, choice: KernelChoice, packed: torch.Tensor,
           owners: dict[int, int]) -> int:
    """Give ``module`` the kernel ``choice`` names; returns the bytes this adds."""
    module.linear_kernel = choice.kernel
    weight = module.weight
    size = weight.numel() * weight.element_size()
    if choice.kernel == PLAIN:
        return 0
    if choice.kernel == BOTH:
        module.packed_weight = packed
        module.packed_min_rows = choice.packed_min_rows
        return size
    # Packed: the packed copy replaces the weight, which is freed unless another module shares it.
    module.weight = nn.Parameter(packed, requires_grad=False)
    return size if owners.get(id(weight), 0) > 1 else 0


def _measure(modules: list[nn.Module], packed: dict[int, torch.Tensor]
             ) -> tuple[float, dict[tuple[int, int], float]]:
    """``_time_kernels``'s ratios from the clearest of up to ``TUNE_ATTEMPTS`` measurements.

    A machine busy with other processes stalls both kernels alike: ratios drift to 1.00, a tie
    that would keep every weight packed (question 1) or plain (question 2); on the AVX-512
    machine, measured beside another process's test runs, 1 start in 3 read 1.00 at one row
    where quiet starts read 0.72-0.82. So a measurement that was disturbed, or that reads a
    tie at one row, is repeated, and the undisturbed one with the clearest one-row answer kept.
    """
    started = time.perf_counter()
    attempts = []
    while True:
        one_row, batch, busy = _time_kernels(modules, packed)
        attempts.append((busy >= BUSY, -abs(one_row - 1), one_row, batch))
        clear = busy < BUSY and abs(one_row - 1) >= MARGIN
        if (clear or len(attempts) == TUNE_ATTEMPTS
                or time.perf_counter() - started > TUNE_BUDGET_S):
            break
        logger.info("CPU linear kernels: plain/packed time at one row %.2f, measured in %.1fx "
                    "the time its calls take on a quiet machine; measuring again", one_row, busy)
    _, _, one_row, batch = min(attempts, key=lambda a: a[:2])
    logger.info("CPU linear kernels: plain/packed time at one row %.2f (%d measurement(s), "
                "%.2f s)", one_row, len(attempts), time.perf_counter() - started)
    return one_row, batch


def _time_kernels(modules: list[nn.Module], packed: dict[int, torch.Tensor]
                  ) -> tuple[float, dict[tuple[int, int], float], float]:
    """Plain time / packed time at one row over every module, and at ``BATCH_ROWS`` per weight
    shape: sums over the modules of each call's fastest time in ``TUNE_REPEATS`` passes; and
    how disturbed the measurement was (its wall time over what its calls' fastest times add
    up to).

    Measured beside another process's tests, a call whose OpenMP region waits for a descheduled
    thread takes a whole scheduler slice (~8 ms, against 0.1-0.7 ms): totals or medians over a
    few passes, or ratios of paired calls (both stalled: 1.00), gave other answers from one
    start to the next; a call's fastest time over several passes is one that was not stalled.
    Each weight is multiplied by one kernel and then the other, back to back (which goes first
    alternates between passes), and every pass goes through the weights in model order, so each
    comes from memory as in a step, not from a cache that only its shape filled."""
    started = time.perf_counter()
    clock = time.perf_counter
    fastest: dict[int, list[list[float]]] = {}
    with torch.inference_mode():
        for rows in (1, BATCH_ROWS):
            inputs = {k: torch.randn(rows, k) for k in {_shape(m)[1] for m in modules}}
            best = fastest[rows] = [[float("inf"), float("inf")] for _ in modules]
            for repeat in range(TUNE_REPEATS + 1):
                for module, times in zip(modules, best):
                    x = inputs[_shape(module)[1]]
                    calls = ((0, _mkl_linear, module.weight),
                             (1, _onednn_linear, packed[id(module)]))
                    for kernel, run, weight in calls if repeat % 2 else calls[::-1]:
                        began = clock()
                        run(x, weight, None)
                        if repeat:  # the first pass warms oneDNN's primitive cache up
                            times[kernel] = min(times[kernel], clock() - began)
    wall = time.perf_counter() - started
    quiet = (TUNE_REPEATS + 1) * sum(sum(t) for best in fastest.values() for t in best)

    def ratio(rows: int, shape: tuple[int, int] | None) -> float:
        pairs = [t for m, t in zip(modules, fastest[rows]) if shape in (None, _shape(m))]
        return sum(t[0] for t in pairs) / sum(t[1] for t in pairs)

    return (ratio(1, None), {s: ratio(BATCH_ROWS, s) for s in {_shape(m) for m in modules}},
            wall / quiet)
