"""What a model runner does once before serving, after its KV pool has its final size, and what
that cost (``ServingStartup``, set as ``runner.startup_report`` for the benchmarks)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from workers.cuda_graphs import capture_decode_graphs, select_graph_backend
from kernels.variants import recording
from workers.kernel_warmup import warm_up_graph_paths, warm_up_kernels
from workers.piecewise_graphs import capture_piecewise_graphs
from workers.startup_report import ServingStartup

if TYPE_CHECKING:
    from workers.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def prepare_for_serving(runner: ModelRunner, max_model_len: int, max_num_seqs: int,
                        tp_size: int = 1) -> None:
    """Compile every Triton kernel variant (no compile may stall serving), then capture the
    CUDA graphs over the compiled kernels: full graphs for decode batches, pieces between the
    attention ops for steps with prefill tokens. Every TP rank runs the same steps, so their
    collectives match. Sets ``runner.startup_report``."""
    runner.startup_report = None
    delay = runner.layer_delay
    if delay is not None:
        delay.paused = True  # a test hook's sleeps: no test times the startup passes
    try:
        runner.startup_report = _warm_up_and_capture(runner, max_model_len, max_num_seqs,
                                                     tp_size)
    finally:
        if delay is not None:
            delay.paused = False


def _warm_up_and_capture(runner: ModelRunner, max_model_len: int, max_num_seqs: int,
                         tp_size: int) -> ServingStartup:
    started = time.perf_counter()
    runner.kernel_warmup = warm_up_kernels(runner, max_model_len, max_num_seqs)
    warmup_s = time.perf_counter() - started
    backend = select_graph_backend(runner, tp_size)
    if backend is None:
        return ServingStartup(warmup_s=warmup_s, capture_s=0.0, graph_memory_bytes=None,
                              decode_sizes=0, piece_sizes=0, pieces=0, graphs=0)
    before = _device_memory(runner.device)
    started = time.perf_counter()
    with recording() as captured:
        runner.graphs = capture_decode_graphs(runner, max_num_seqs, max_model_len,
                                              backend=backend)
        runner.piecewise = capture_piecewise_graphs(runner, runner.buffers.max_tokens, backend)
    capture_s = time.perf_counter() - started
    after = _device_memory(runner.device)
    if runner.kernel_warmup is not None:
        started = time.perf_counter()
        runner.kernel_warmup = warm_up_graph_paths(runner, runner.kernel_warmup, max_model_len,
                                                   max_num_seqs, captured)
        warmup_s += time.perf_counter() - started
    graph_memory_bytes = None
    if before is not None and after is not None:
        # They come out of the headroom --gpu-memory-utilization leaves (the KV pool was sized
        # before the capture, whose graphs read its addresses), as in vLLM.
        in_use, total = after
        graph_memory_bytes = in_use - before[0]
        logger.info("CUDA graphs: %.2f GiB of device memory (graph pools and static buffers); "
                    "%.2f of %.2f GiB in use on the device now", graph_memory_bytes / 2**30,
                    in_use / 2**30, total / 2**30)
    decode_sizes = len(runner.graphs.graphs) if runner.graphs is not None else 0
    piece_sizes = len(runner.piecewise.graphs)
    pieces = piece_sizes * (runner.piecewise.num_layers + 1)
    return ServingStartup(warmup_s=warmup_s, capture_s=capture_s,
                          graph_memory_bytes=graph_memory_bytes, decode_sizes=decode_sizes,
                          piece_sizes=piece_sizes, pieces=pieces, graphs=decode_sizes + pieces)


def _device_memory(device: torch.device) -> tuple[int, int] | None:
    """(bytes in use, total bytes) on a CUDA device; None elsewhere."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free, total
