"""What a model runner does once before serving, after its KV pool has its final size."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from workers.cuda_graphs import capture_decode_graphs, select_graph_backend
from kernels.variants import recording
from workers.kernel_warmup import warm_up_graph_paths, warm_up_kernels
from workers.piecewise_graphs import capture_piecewise_graphs

if TYPE_CHECKING:
    from workers.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def prepare_for_serving(runner: ModelRunner, max_model_len: int, max_num_seqs: int,
                        tp_size: int = 1) -> None:
    """Compile every Triton kernel variant (no compile may stall serving), then capture the
    CUDA graphs over the compiled kernels: full graphs for decode batches, pieces between the
    attention ops for steps with prefill tokens. Every TP rank runs the same steps, so their
    collectives match."""
    delay = runner.layer_delay
    if delay is not None:
        delay.paused = True  # a test hook's sleeps: no test times the startup passes
    try:
        _warm_up_and_capture(runner, max_model_len, max_num_seqs, tp_size)
    finally:
        if delay is not None:
            delay.paused = False


def _warm_up_and_capture(runner: ModelRunner, max_model_len: int, max_num_seqs: int,
                         tp_size: int) -> None:
    runner.kernel_warmup = warm_up_kernels(runner, max_model_len, max_num_seqs)
    backend = select_graph_backend(runner, tp_size)
    if backend is None:
        return
    before = _device_memory(runner.device)
    with recording() as captured:
        runner.graphs = capture_decode_graphs(runner, max_num_seqs, max_model_len,
                                              backend=backend)
        runner.piecewise = capture_piecewise_graphs(runner, runner.buffers.max_tokens, backend)
    after = _device_memory(runner.device)
    if runner.kernel_warmup is not None:
        runner.kernel_warmup = warm_up_graph_paths(runner, runner.kernel_warmup, max_model_len,
                                                   max_num_seqs, captured)
    if before is not None and after is not None:
        # They come out of the headroom --gpu-memory-utilization leaves (the KV pool was sized
        # before the capture, whose graphs read its addresses), as in vLLM.
        in_use, total = after
        logger.info("CUDA graphs: %.2f GiB of device memory (graph pools and static buffers); "
                    "%.2f of %.2f GiB in use on the device now", (in_use - before[0]) / 2**30,
                    in_use / 2**30, total / 2**30)


def _device_memory(device: torch.device) -> tuple[int, int] | None:
    """(bytes in use, total bytes) on a CUDA device; None elsewhere."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free, total
