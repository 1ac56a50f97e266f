"""The device's limits and each figure's bound: the FLOP and byte counts of
engine/benchmarks/measure/roofline.py for the shape, at the copy bandwidth and matmul rate measured on
the device (engine/benchmarks/measure/machine_limits.py), and the recorder that writes each figure
beside its bound as it is measured."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from engine.benchmarks.device_throughput.report import graphs_vs_eager_row, side_figures
from engine.benchmarks.measure.figures import FigureLog
from engine.benchmarks.measure.roofline import (ModelShape, attention_flops, decode_bytes_per_step,
                                        decode_flops_per_step, prefill_flops)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def measure_limits(device: torch.device, dtype: torch.dtype, matmul_size: int) -> dict[str, Any]:
    """Copy bandwidth and square-matmul TFLOP/s, measured by engine/benchmarks/measure/machine_limits.py."""
    from engine.benchmarks.measure import machine_limits

    limits = machine_limits.measure_limits(device, dtype, matmul_size)
    _progress(f"limits: copy {limits['copy_bandwidth_gbs']:.0f} GB/s, "
              f"matmul {limits['matmul_tflops']:.3g} TFLOP/s")
    return limits


def prefill_bound(shape: ModelShape, prompt_len: int, limits: dict[str, Any]) -> dict[str, float]:
    flops = sum(prefill_flops(shape, prompt_len).values())
    seconds = flops / (limits["matmul_tflops"] * 1e12)
    return {"flops": flops, "step_ms": 1000 * seconds, "tokens_per_s": prompt_len / seconds}


def decode_bound(shape: ModelShape, batch: int, mean_context: float, dtype_bytes: int,
                 limits: dict[str, Any]) -> dict[str, float]:
    contexts = [round(mean_context)] * batch
    nbytes = decode_bytes_per_step(shape, contexts, dtype_bytes)["total"]
    flops = sum(decode_flops_per_step(shape, contexts).values())
    memory_s = nbytes / (limits["copy_bandwidth_gbs"] * 1e9)
    compute_s = flops / (limits["matmul_tflops"] * 1e12)
    step_s = max(memory_s, compute_s)
    return {"bytes_per_step": nbytes, "flops_per_step": flops, "memory_ms": 1000 * memory_s,
            "compute_ms": 1000 * compute_s, "tpot_ms": 1000 * step_s,
            "tokens_per_s": batch / step_s}


def mixed_bound(shape: ModelShape, figures: dict[str, Any], dtype_bytes: int,
                limits: dict[str, Any]) -> dict[str, float]:
    """A mixed step: the decodes as in `decode_bound`, and the chunk's linear layers, its
    attention over its prefix and itself, and the K/V of both that it reads."""
    decodes = [round(figures["mean_context"])] * figures["batch"]
    chunk, start = figures["chunk"], round(figures["mean_chunk_start"])
    nbytes = decode_bytes_per_step(shape, [*decodes, start + chunk], dtype_bytes)["total"]
    flops = (sum(decode_flops_per_step(shape, decodes).values())
             + 2 * shape.linear_params * chunk + attention_flops(shape, start, chunk))
    memory_s = nbytes / (limits["copy_bandwidth_gbs"] * 1e9)
    compute_s = flops / (limits["matmul_tflops"] * 1e12)
    step_s = max(memory_s, compute_s)
    return {"bytes_per_step": nbytes, "flops_per_step": flops, "memory_ms": 1000 * memory_s,
            "compute_ms": 1000 * compute_s, "tpot_ms": 1000 * step_s,
            "tokens_per_s": figures["tokens_per_step"] / step_s}


def bound_of(kind: str, figures: dict[str, Any], shape: ModelShape, dtype_bytes: int,
             limits: dict[str, Any]) -> dict[str, Any]:
    """{"bound", "pct_of_bound"} of one figure (kind prefill, decode or mixed) at its own
    sizes."""
    if kind == "prefill":
        bound = prefill_bound(shape, figures["prompt_len"], limits)
    elif kind == "decode":
        bound = decode_bound(shape, figures["batch"], figures["mean_context"], dtype_bytes,
                             limits)
    else:
        bound = mixed_bound(shape, figures, dtype_bytes, limits)
    return {"bound": bound, "pct_of_bound": 100 * figures["tokens_per_s"] / bound["tokens_per_s"]}


def add_bounds(side: dict[str, Any], shape: ModelShape, dtype_bytes: int,
               limits: dict[str, Any]) -> None:
    """Each figure of one side (engine or HF) beside the bound at its own sizes."""
    side["prefill"].update(bound_of("prefill", side["prefill"], shape, dtype_bytes, limits))
    for row in side["decode"].values():
        row.update(bound_of("decode", row, shape, dtype_bytes, limits))
    if "mixed" in side:
        side["mixed"].update(bound_of("mixed", side["mixed"], shape, dtype_bytes, limits))


class FigureRecorder:
    """Writes each figure to the run's JSON-lines file as it is measured
    (engine.benchmarks.measure.figures), its
    bound beside it (the limits are measured first), and each graphs-against-eager row as
    soon as its graphs figure exists (the eager engine runs first): a run killed at its time
    limit keeps every figure it had."""

    def __init__(self, log: FigureLog, shape: ModelShape, dtype_bytes: int,
                 limits: dict[str, Any]) -> None:
        self.log, self.shape, self.dtype_bytes, self.limits = log, shape, dtype_bytes, limits
        # The eager engine's figures by table label, for the graphs engine's rows.
        self.eager: dict[str, dict[str, Any]] = {}

    def for_side(self, side: str) -> Callable[[str, dict[str, Any]], None]:
        def record(kind: str, figures: dict[str, Any]) -> None:
            fields = dict(figures)
            if kind in ("prefill", "decode", "mixed"):
                fields.update(bound_of(kind, figures, self.shape, self.dtype_bytes, self.limits))
            self.log.write(kind, side=side, **fields)
            if kind not in ("decode", "mixed"):
                return
            label = kind if kind == "mixed" else f"decode {figures['batch']}"
            if side == "eager":
                self.eager[label] = figures
            elif side == "engine" and label in self.eager:
                self.log.write("graphs_vs_eager", **graphs_vs_eager_row(
                    kind, figures, self.eager[label]))
        return record

    def hf(self, hf: dict[str, Any]) -> None:
        """HF's figures, all at once: its process reports when it ends."""
        record = self.for_side("hf")
        for label, (kind, figures) in side_figures(hf).items():
            record(kind, figures)
