"""What a model runner's startup before serving cost (``runner.startup_report``, measured by
workers.startup.serving_startup; the GPU suite's benchmarks read it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServingStartup:
    """What getting ready to serve cost (the GPU suite reports it: an 8B engine captures about
    2,200 graphs at every start)."""

    # The kernel warm-up's steps, before the capture and after it (the graph paths).
    warmup_s: float
    # Capturing every graph; 0.0 with graphs off.
    capture_s: float
    # Device memory the capture took (graph pools and static buffers); None off CUDA, or with
    # graphs off.
    graph_memory_bytes: int | None
    # Decode batch sizes captured as whole graphs.
    decode_sizes: int
    # Step sizes (tokens) captured as pieces, and the pieces over all of them.
    piece_sizes: int
    pieces: int
    # Every graph captured: decode_sizes + pieces (a field, so that dataclasses.asdict has it).
    graphs: int
