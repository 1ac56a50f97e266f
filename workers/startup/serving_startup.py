"""What getting ready to serve costs, measured around the steps ``ModelRunner.prepare_for_serving``
runs once before serving (the kernel warm-up, then the CUDA graph capture), and reported as
``ServingStartup`` (``runner.startup_report``, for the benchmarks)."""

from __future__ import annotations

import logging
import time
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from workers.startup.startup_report import ServingStartup

if TYPE_CHECKING:
    from workers.graphs.cuda_graphs import DecodeGraphs
    from workers.graphs.piecewise_graphs import PiecewiseGraphs

logger = logging.getLogger(__name__)


def without_graphs(warmup_s: float) -> ServingStartup:
    """The startup of a runner that captures no graphs (the CPU, --enforce-eager, TP > 1)."""
    return ServingStartup(warmup_s=warmup_s, capture_s=0.0, graph_memory_bytes=None,
                          decode_sizes=0, piece_sizes=0, pieces=0, graphs=0)


class CaptureCost:
    """Around the capture: its time, and on CUDA the device memory it took."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._before: tuple[int, int] | None = None
        self._after: tuple[int, int] | None = None
        self._started = 0.0
        self.capture_s = 0.0

    def __enter__(self) -> CaptureCost:
        self._before = _device_memory(self.device)
        self._started = time.perf_counter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if exc_type is not None:
            return
        self.capture_s = time.perf_counter() - self._started
        self._after = _device_memory(self.device)

    def report(self, warmup_s: float, graphs: DecodeGraphs | None,
               piecewise: PiecewiseGraphs | None) -> ServingStartup:
        graph_memory_bytes = None
        if self._before is not None and self._after is not None:
            # They come out of the headroom --gpu-memory-utilization leaves (the KV pool was
            # sized before the capture, whose graphs read its addresses), as in vLLM.
            in_use, total = self._after
            graph_memory_bytes = in_use - self._before[0]
            logger.info("CUDA graphs: %.2f GiB of device memory (graph pools and static "
                        "buffers); %.2f of %.2f GiB in use on the device now",
                        graph_memory_bytes / 2**30, in_use / 2**30, total / 2**30)
        decode_sizes = len(graphs.graphs) if graphs is not None else 0
        piece_sizes = len(piecewise.graphs) if piecewise is not None else 0
        pieces = piece_sizes * (piecewise.num_layers + 1) if piecewise is not None else 0
        return ServingStartup(warmup_s=warmup_s, capture_s=self.capture_s,
                              graph_memory_bytes=graph_memory_bytes, decode_sizes=decode_sizes,
                              piece_sizes=piece_sizes, pieces=pieces,
                              graphs=decode_sizes + pieces)


def _device_memory(device: torch.device) -> tuple[int, int] | None:
    """(bytes in use, total bytes) on a CUDA device; None elsewhere."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free, total
