"""Piecewise CUDA graphs for steps that carry prefill tokens (issue 26, item 1).

A step with a prefill chunk may be preemptible: before every attention op the workers vote on
stopping it (docs/design.md section 4), so no graph may span an attention op. Such a step runs as
``num_layers + 1`` captured pieces with the attention ops eager between them:

    piece 0:       rotary table lookup, embedding, layer 0 up to its attention op
    piece i:       layer i-1 after its attention op (o_proj, norm, MLP), layer i up to its op
    piece L:       layer L-1 after its attention op, the final norm

An 8B layer launches about 30 kernels besides attention; a piece is one launch. The attention op
(KV write, paged attention), the vote and the run-ahead pacing stay in Python at the boundary,
exactly where they are in an eager pass, so preemption behaves the same with graphs on.

Every tensor that crosses a boundary lives in a static buffer of this class (q, k, v, the
attention output, the residual stream, cos/sin, the final hidden states), sized for the largest
captured token count; the step's token ids and positions are the runner's step buffers. A step of
n tokens replays the pieces of the smallest captured size T >= n; rows n..T-1 hold whatever an
earlier step left there (valid token ids and positions), every op in a piece is row-wise, and the
attention ops read and write only rows < n, so the padding never reaches a real row or the cache.
Nothing a piece allocates outlives its replay, so every piece of every size shares one memory pool.

Steps that resume a suspended chunk (its activations join at a later layer, changing the row
count mid-pass) and steps larger than the largest size run eager. When a vote stops a replayed
step at layer L, the residual stream entering layer L is the residual buffer (piece L has
already added layer L's input to it); the suspended chunk keeps it as (hidden = stream,
residual = 0), which layer L's input norm turns into the same values as the eager pair.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.core.scheduler_output import SchedulerOutput
from kernels import AttentionMetadata
from workers.graphs.cuda_graphs import CapturedSteps, no_collection_while_capturing
from workers.graphs.graph_shapes import capture_sizes, padded_batch_size
from workers.preemption.slo_preempt_vote import StepSLOPreempted

if TYPE_CHECKING:
    from workers.graphs.cuda_graphs import GraphBackend, Runner

logger = logging.getLogger(__name__)


@dataclass
class PieceBuffers:
    """The static tensors that cross the boundaries between pieces, [rows, ...] each."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_out: torch.Tensor
    residual: torch.Tensor
    hidden_out: torch.Tensor
    # The step's rotary cos / sin, per table (DecoderModel.layer_rope_kind's keys).
    cos: dict[str, torch.Tensor]
    sin: dict[str, torch.Tensor]

    @classmethod
    def allocate(cls, model: Any, rows: int) -> PieceBuffers:
        attn = model.model.layers[0].self_attn
        hidden_size = model.config.hidden_size
        head_dim = attn.head_dim
        half_rotary = model.model.rotary_emb.rotary_dim // 2
        kinds = model.model.rotary_embs.keys()

        def empty(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=model.dtype, device=model.device)

        return cls(query=empty(rows, attn.num_heads, head_dim),
                   key=empty(rows, attn.num_kv_heads, head_dim),
                   value=empty(rows, attn.num_kv_heads, head_dim),
                   attention_out=empty(rows, attn.num_heads, head_dim),
                   residual=empty(rows, hidden_size), hidden_out=empty(rows, hidden_size),
                   cos={kind: empty(rows, 1, half_rotary) for kind in kinds},
                   sin={kind: empty(rows, 1, half_rotary) for kind in kinds})

    def store(self, size: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              residual: torch.Tensor) -> None:
        self.query[:size].copy_(q)
        self.key[:size].copy_(k)
        self.value[:size].copy_(v)
        self.residual[:size].copy_(residual)


class PiecewiseGraphs(CapturedSteps):
    kind = "prefill"

    def __init__(self, runner: Runner, sizes: Sequence[int], backend: GraphBackend) -> None:
        super().__init__(runner, sizes, backend)
        self.num_layers: int = runner.model.num_layers
        # graphs[size][i]: piece i (0..num_layers) of a step padded to ``size`` tokens.
        self.graphs: dict[int, list[Any]] = {}
        # Replayed steps a vote stopped between two pieces.
        self.unwinds = 0
        # A separate object, so that the pieces (which the CPU stand-in's graphs keep) can
        # close over it without closing over this one, which holds the graphs.
        self.static = PieceBuffers.allocate(self.model, self.sizes[-1])

    # -- the pieces ------------------------------------------------------------------------

    def _piece(self, size: int, index: int) -> Callable[[], torch.Tensor]:
        """Piece ``index`` of a ``size``-token step, reading and writing only static buffers.
        It closes over locals only (never ``self``: see ``self.static``)."""
        model = self.model.model
        layers = model.layers
        buffers = self.buffers
        static = self.static
        # The layer's own rotary table (one for every layer in most families).
        kind = model.layer_rope_kind[min(index, self.num_layers - 1)]
        cos, sin = static.cos[kind][:size], static.sin[kind][:size]

        def first() -> torch.Tensor:
            for table, (step_cos, step_sin) in model.rope_tables(buffers.positions[:size]).items():
                static.cos[table][:size].copy_(step_cos)
                static.sin[table][:size].copy_(step_sin)
            hidden = model.embed(buffers.input_ids[:size])
            static.store(size, *layers[0].before_attention(hidden, None, cos, sin))
            return static.query[:size]

        def middle() -> torch.Tensor:
            hidden, residual = layers[index - 1].after_attention(static.attention_out[:size],
                                                                 static.residual[:size])
            static.store(size, *layers[index].before_attention(hidden, residual, cos, sin))
            return static.query[:size]

        def last() -> torch.Tensor:
            hidden, residual = layers[index - 1].after_attention(static.attention_out[:size],
                                                                 static.residual[:size])
            hidden, _ = model.norm(hidden, residual)
            static.hidden_out[:size].copy_(hidden)
            return static.hidden_out[:size]

        if index == 0:
            return first
        return last if index == self.num_layers else middle

    # -- capture and replay ----------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every piece of every size, largest size first; returns the seconds taken."""
        started = time.perf_counter()
        buffers = self.buffers
        buffers.reserve(self.sizes[-1], 1, 1)
        self.generation = buffers.generation
        with no_collection_while_capturing():
            for size in reversed(self.sizes):
                pieces = []
                for index in range(self.num_layers + 1):
                    graph, _ = self._capture_one(self._piece(size, index),
                                                 f"piece {index} of a {size}-token step")
                    pieces.append(graph)
                self.graphs[size] = pieces
        self._check_buffers_held_still()
        self.capture_seconds = time.perf_counter() - started
        return self.capture_seconds

    def size_for(self, scheduler_output: SchedulerOutput) -> int | None:
        """The padded token count this step replays at, or None: it runs eager (it resumes a
        suspended chunk, it is larger than the largest size, or the buffers moved)."""
        if self._buffers_moved():
            return None
        requests = scheduler_output.requests
        if not requests or any(r.resume for r in requests):
            return None
        num_tokens = sum(len(r.token_ids) for r in requests)
        size = padded_batch_size(num_tokens, self.sizes)
        return size if size in self.graphs else None

    def run(self, size: int, num_tokens: int, attn_meta: AttentionMetadata,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The step's final-normed hidden states [num_tokens, hidden] (a view of a static
        buffer, valid until the next step). The attention ops run eager on the real rows, with
        the vote before each; a stop raises StepSLOPreempted carrying the stopped layer's inputs."""
        model, static = self.model, self.static
        pieces = self.graphs[size]
        n = num_tokens
        replay = self.backend.replay
        layer = 0
        try:
            for layer in range(self.num_layers):
                replay(pieces[layer])
                model.attention_op(layer, static.query[:n], static.key[:n], static.value[:n],
                                   attn_meta, kv_caches[layer], out=static.attention_out[:n])
            replay(pieces[self.num_layers])
        except StepSLOPreempted as stop:
            self.unwinds += 1
            stream = static.residual[:n].clone()
            if layer == 0:
                # As an eager pass reports it: the embedding, and no residual yet.
                stop.hidden_states, stop.residual = stream, None
            else:
                stop.hidden_states, stop.residual = stream, torch.zeros_like(stream)
            raise
        self.replays += 1
        return static.hidden_out[:n]


def capture_piecewise_graphs(runner: Runner, max_num_batched_tokens: int,
                             backend: GraphBackend) -> PiecewiseGraphs:
    """Capture the pieces for every token count of ``capture_sizes`` up to the step budget
    (at most the runner's max_cudagraph_capture_size, MAX_CAPTURE_SIZE by default: larger steps are
    compute-bound, their launches hide behind the matmuls)."""
    sizes = capture_sizes(max_num_batched_tokens, runner.max_cudagraph_capture_size)
    graphs = PiecewiseGraphs(runner, sizes, backend)
    seconds = graphs.capture()
    logger.info("CUDA graphs: captured %d pieces for each of %d step sizes (%d..%d tokens) in "
                "%.2f s", graphs.num_layers + 1, len(sizes), sizes[0], sizes[-1], seconds)
    return graphs
