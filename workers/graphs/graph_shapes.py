"""Which shapes run as captured CUDA graphs, and at what padded size.

A CUDA graph replays fixed shapes, so decode-only steps are captured for a few batch sizes
(workers.graphs.cuda_graphs) and steps with prefill tokens for a few token counts
(workers.graphs.piecewise_graphs), and a step runs the smallest captured size that holds it, its extra
rows padding (vLLM's scheme, whose default sizes these are: 1, 2, 4, then every multiple of 8,
up to --max-cudagraph-capture-size). A step that fits no captured size, or every step under
``--enforce-eager``, runs eager.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from engine.config import ModelConfig

# The default cap on the captured sizes (--max-cudagraph-capture-size, vLLM's 512; defined in
# ModelConfig): past it, a graph per size costs more memory and startup time than the launches
# it saves (a large batch's step is dominated by its matmuls).
MAX_CAPTURE_SIZE = ModelConfig.max_cudagraph_capture_size


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The decode batch sizes to capture: [1, 2, 4] and the multiples of 8, up to
    min(max_num_seqs, limit), ascending."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    top = min(max_num_seqs, limit)
    return [size for size in [1, 2, 4, *range(8, top + 1, 8)] if size <= top]


def padded_batch_size(num_decodes: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size (``sizes`` ascending) that holds ``num_decodes`` decodes, or
    None when none does (the step runs eager)."""
    if num_decodes < 1:
        return None
    index = bisect.bisect_left(sizes, num_decodes)
    return sizes[index] if index < len(sizes) else None
