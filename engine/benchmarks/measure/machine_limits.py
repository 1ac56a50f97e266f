"""A device's limits, measured one way for every benchmark: memory bandwidth and matmul peak, on
the CPU or a CUDA device.

Two bandwidths, because two different quantities are wanted:

- `copy_gbps`: a device-to-device copy, bytes read + bytes written per second (the kernel
  benchmark's fallback peak, and the GPU throughput benchmark's decode bound);
- `read_gbps`: a sum over a float32 buffer far past the caches, bytes read per second (decode
  mostly reads: the CPU roofline's decode bound and the CPU attention diagnostic).

`matmul_tflops` is a square GEMM in the caller's dtype. Every figure is the median of a `Timer`:
on CUDA one event pair around each call with the L2 flushed before it, on the CPU perf_counter.
Users: engine/benchmarks/measure/roofline.py, engine/benchmarks/device_throughput/, the kernel
benchmark (bench/kernels/) and bench/diagnostics/cpu_attention.py.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

# The L2 cache is overwritten before every timed call: small shapes fit in L2, and repeated calls
# would otherwise overstate HBM bandwidth.
FLUSH_BYTES = 256 << 20


class Timer:
    """Median milliseconds of `fn()` over `repeats` calls after `warmup` calls. CUDA: one event
    pair around each call, with the L2 flushed (outside the events) before it. CPU: perf_counter.
    """

    def __init__(self, device: torch.device, warmup: int, repeats: int) -> None:
        self.device, self.warmup, self.repeats = device, warmup, repeats
        self.flush = (torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
                      if device.type == "cuda" else None)

    def __call__(self, fn: Callable[[], Any]) -> float:
        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            times = []
            for _ in range(self.repeats):
                started = time.perf_counter()
                fn()
                times.append((time.perf_counter() - started) * 1000)
            return statistics.median(times)
        assert self.flush is not None
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
        for start, end in zip(starts, ends):
            self.flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def copy_gbps(device: torch.device, timer: Timer, nbytes: int | None = None) -> float:
    """Device-to-device copy bandwidth: bytes read + bytes written per second, of a buffer of
    `nbytes` (default: 64 MiB on the CPU; on CUDA 1 GiB or a quarter of the free memory)."""
    if nbytes is None:
        nbytes = 64 << 20
        if device.type == "cuda":
            nbytes = min(1 << 30, torch.cuda.mem_get_info(device)[0] // 4)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms / 1000) / 1e9


def read_gbps(device: torch.device, timer: Timer, nbytes: int = 512 << 20) -> float:
    """Read bandwidth: a sum over `nbytes` of float32 (far past the caches), bytes read per
    second."""
    data = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    ms = timer(lambda: data.sum())
    return nbytes // 4 * 4 / (ms / 1000) / 1e9


def matmul_tflops(device: torch.device, dtype: torch.dtype, size: int, timer: Timer) -> float:
    """TFLOP/s of a square [size, size] @ [size, size] torch.matmul in `dtype`."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    ms = timer(lambda: torch.matmul(a, b))
    return 2 * size**3 / (ms / 1000) / 1e12


def measure_limits(device: torch.device, dtype: torch.dtype, matmul_size: int) -> dict[str, Any]:
    """The GPU throughput benchmark's limits: copy bandwidth and square-matmul TFLOP/s."""
    # CUDA: events, L2 flushed before each call; CPU: perf_counter.
    timer = Timer(device, warmup=3 if device.type == "cuda" else 1,
                  repeats=10 if device.type == "cuda" else 3)
    gbps = copy_gbps(device, timer)
    tflops = matmul_tflops(device, dtype, matmul_size, timer)
    del timer
    if device.type == "cuda":
        torch.cuda.empty_cache()  # nothing of this stays in the engine's way
    return {"copy_bandwidth_gbs": gbps, "matmul_tflops": tflops, "matmul_size": matmul_size,
            "matmul_dtype": str(dtype).removeprefix("torch.")}
