"""What a model runner does once before serving, after its KV pool has its final size."""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.cuda_graphs import capture_decode_graphs
from workers.kernel_warmup import warm_up_kernels

if TYPE_CHECKING:
    from workers.model_runner import ModelRunner


def prepare_for_serving(runner: ModelRunner, max_model_len: int, max_num_seqs: int,
                        tp_size: int = 1) -> None:
    """Compile every Triton kernel variant (no compile may stall serving), then capture the
    decode CUDA graphs over the compiled kernels. Every TP rank runs the same steps, so their
    collectives match."""
    runner.kernel_warmup = warm_up_kernels(runner, max_model_len, max_num_seqs)
    runner.graphs = capture_decode_graphs(runner, max_num_seqs, max_model_len, tp_size)
