"""Piecewise CUDA graphs for steps that carry prefill tokens.

A step with a prefill chunk may be preemptible: before every attention op the workers vote on
stopping it (docs/design.md section 4), so no graph may span that vote. Such a step runs as
``num_layers + 1`` captured pieces with the vote between them:

    piece 0:       rotary table lookup, embedding, layer 0 up to its attention op
    piece i:       layer i-1's attention op (KV write, paged attention), the rest of layer i-1
                   (o_proj, norm, MLP), layer i up to its attention op
    piece L:       layer L-1's attention op and the rest of it, the final norm

An 8B layer launches about 30 kernels besides attention; a piece is one launch. Between two
pieces runs only the attention boundary (``model.attention_boundary``: the vote and the run-ahead
pacing), exactly where it is in an eager pass, so preemption behaves the same with graphs on. A
step that cannot be stopped (the scheduler did not mark it preemptible: no vote) replays all of
its size's pieces as one whole captured graph instead.

The attention inside a piece reads the step's layout on the device (workers.graphs.attention_layout:
every sequence a chunk, a fixed grid per size), which only the Triton kernels do. With the
PyTorch kernels (which read host-side lengths) the attention op stays eager at the boundary, on
the real rows, and the pieces hold only the code between two attention ops; no whole graphs.

Every tensor that crosses a boundary lives in a static buffer of this class (q, k, v, the
attention output, the residual stream, cos/sin, the final hidden states), sized for the largest
captured token count; the step's token ids, positions and KV slots are the runner's step
buffers. A step of n tokens replays the pieces of the smallest captured size T >= n; rows
n..T-1 hold whatever an earlier step left there (valid token ids and positions), every op in a
piece is row-wise, the padding rows' KV slots are -1 (nothing written) and no attention tile
covers them, so the padding never reaches a real row or the cache. Nothing a piece allocates
outlives its replay, so every piece of every size shares one memory pool.

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

import numpy as np
import torch

from engine.core.scheduler_output import SchedulerOutput
from kernels import AttentionMetadata
from workers.graphs.attention_layout import AttentionLayouts
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
        # whole[size]: every piece of ``size`` in one graph, for the steps that cannot be
        # stopped (empty where the pieces do not hold the attention).
        self.whole: dict[int, Any] = {}
        # Replayed steps a vote stopped between two pieces; steps replayed whole.
        self.unwinds = 0
        self.whole_replays = 0
        # A separate object, so that the pieces (which the CPU stand-in's graphs keep) can
        # close over it without closing over this one, which holds the graphs.
        self.static = PieceBuffers.allocate(self.model, self.sizes[-1])
        # The pool the pieces' attention writes to: the final one (sized before the capture).
        self.kv_caches = runner.kv_caches
        # The attention inside the pieces, reading the step's layout on the device (Triton
        # kernels only); None: the attention op runs eager between the pieces.
        self.layouts: AttentionLayouts | None = None
        if self.model.kernels.name == "triton":
            from kernels.triton_attention import layout_block_q

            attn = self.model.model.layers[0].self_attn
            self.layouts = AttentionLayouts(self.buffers,
                                            layout_block_q(attn.num_heads, attn.num_kv_heads),
                                            self.sizes[-1])

    @property
    def holds_attention(self) -> bool:
        """Whether the pieces hold the attention (so the padding rows' KV slots must be -1)."""
        return self.layouts is not None

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
        attend = self._attention(size, index - 1) if index > 0 else None

        def first() -> torch.Tensor:
            for table, (step_cos, step_sin) in model.rope_tables(buffers.positions[:size]).items():
                static.cos[table][:size].copy_(step_cos)
                static.sin[table][:size].copy_(step_sin)
            hidden = model.embed(buffers.input_ids[:size])
            static.store(size, *layers[0].before_attention(hidden, None, cos, sin))
            return static.query[:size]

        def middle() -> torch.Tensor:
            if attend is not None:
                attend()
            hidden, residual = layers[index - 1].after_attention(static.attention_out[:size],
                                                                 static.residual[:size])
            static.store(size, *layers[index].before_attention(hidden, residual, cos, sin))
            return static.query[:size]

        def last() -> torch.Tensor:
            if attend is not None:
                attend()
            hidden, residual = layers[index - 1].after_attention(static.attention_out[:size],
                                                                 static.residual[:size])
            hidden, _ = model.norm(hidden, residual)
            static.hidden_out[:size].copy_(hidden)
            return static.hidden_out[:size]

        if index == 0:
            return first
        return last if index == self.num_layers else middle

    def _attention(self, size: int, layer: int) -> Callable[[], None] | None:
        """Layer ``layer``'s cache write and attention over the static q/k/v of a ``size``-token
        step, reading the device layout; None where the attention runs eager between pieces."""
        if self.layouts is None:
            return None
        model, static, kv_cache = self.model, self.static, self.kv_caches[layer]
        meta = self.layouts.metadata(size, len(self.buffers.group_block_tables) + 1)

        def attend() -> None:
            model.attend(layer, static.query[:size], static.key[:size], static.value[:size],
                         meta, kv_cache, out=static.attention_out[:size])

        return attend

    @staticmethod
    def _in_order(pieces: list[Callable[[], torch.Tensor]]) -> Callable[[], torch.Tensor]:
        def whole() -> torch.Tensor:
            for piece in pieces[:-1]:
                piece()
            return pieces[-1]()

        return whole

    # -- capture and replay ----------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every piece of every size, largest size first (and each size whole, where
        the pieces hold the attention); returns the seconds taken."""
        started = time.perf_counter()
        buffers = self.buffers
        buffers.reserve(self.sizes[-1], 1, 1)
        self.generation = buffers.generation
        if self.layouts is not None:
            # The captures' runs write no cache and attend over nothing: no sequence, and no
            # token has a slot.
            self.layouts.clear()
            for slots in (buffers.slot_mapping, *buffers.group_slot_mappings):
                slots.fill_(-1)
        with no_collection_while_capturing():
            for size in reversed(self.sizes):
                functions = [self._piece(size, index) for index in range(self.num_layers + 1)]
                self.graphs[size] = [
                    self._capture_one(fn, f"piece {index} of a {size}-token step")[0]
                    for index, fn in enumerate(functions)]
                if self.layouts is not None:
                    self.whole[size], _ = self._capture_one(self._in_order(functions),
                                                            f"the whole {size}-token step")
        self._check_buffers_held_still()
        self.capture_seconds = time.perf_counter() - started
        return self.capture_seconds

    def size_for(self, scheduler_output: SchedulerOutput) -> int | None:
        """The padded token count this step replays at, or None: it runs eager (it resumes a
        suspended chunk, it is larger than the largest size, or the buffers moved)."""
        if self.buffers_moved():
            self.whole.clear()
            return None
        requests = scheduler_output.requests
        if not requests or any(r.resume for r in requests):
            return None
        if self.layouts is not None and len(requests) > self.layouts.max_seqs:
            return None  # more sequences than the step buffers hold (a caller past the limits)
        num_tokens = sum(len(r.token_ids) for r in requests)
        size = padded_batch_size(num_tokens, self.sizes)
        return size if size in self.graphs else None

    def run(self, size: int, num_tokens: int, attn_meta: AttentionMetadata,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            query_lens: np.ndarray | None = None,
            context_lens: np.ndarray | None = None) -> torch.Tensor:
        """The step's final-normed hidden states [num_tokens, hidden] (a view of a static
        buffer, valid until the next step). The attention boundary (the vote) runs between the
        pieces on the real rows; a stop raises StepSLOPreempted carrying the stopped layer's
        inputs. Where the pieces hold the attention, ``query_lens`` / ``context_lens`` (each
        sequence's, in batch order) are written to the device layout first, and a step with no
        vote to cast replays whole."""
        model, static = self.model, self.static
        n = num_tokens
        layouts = self.layouts
        if layouts is not None:
            if query_lens is None or context_lens is None:
                raise ValueError("the pieces hold the attention: the step's lengths are needed")
            layouts.write(query_lens, context_lens)
            if model.before_attention is None:
                self.backend.replay(self.whole[size])
                self.whole_replays += 1
                self.replays += 1
                return static.hidden_out[:n]
        pieces = self.graphs[size]
        replay = self.backend.replay
        layer = 0
        try:
            for layer in range(self.num_layers):
                replay(pieces[layer])
                if layouts is not None:
                    model.attention_boundary(layer, n)
                else:
                    model.attention_op(layer, static.query[:n], static.key[:n],
                                       static.value[:n], attn_meta, kv_caches[layer],
                                       out=static.attention_out[:n])
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
    logger.info("CUDA graphs: captured %d pieces%s for each of %d step sizes (%d..%d tokens) in "
                "%.2f s", graphs.num_layers + 1,
                " holding the attention, and the whole step," if graphs.holds_attention else "",
                len(sizes), sizes[0], sizes[-1], seconds)
    return graphs
