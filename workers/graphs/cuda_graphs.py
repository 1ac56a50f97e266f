"""Full CUDA graphs for decode-only steps: one capture per padded batch size.

A decode step of an 8B model launches about a thousand kernels whose host-side launch cost is
larger than their device time at small batches. Captured as a graph, the step is one launch.
Decode-only steps are never preemptible (the scheduler marks only prefill-carrying steps), so a
graph that runs all the layers at once skips no vote; preemptible steps stay eager.

How a step is replayed:

- Every input the forward pass reads lives in the runner's persistent buffers
  (``workers.step_buffers``): the capture reads them at the addresses it was made with, and each
  step's ``prepare_inputs`` rewrites them in place.
- A batch of n decodes replays the smallest captured size B >= n
  (``workers.graphs.graph_shapes``); the B - n padding rows repeat the last real decode (same token,
  position, slot and table), so they compute the same values and write the same K/V to the same
  slot: no other sequence's cache is touched, and no kernel needs a "skip this row" slot.
- The captured metadata is the same for every replay of a size: B decodes, block tables at their
  full max_model_len width, and a longest context of max_model_len, so the attention launch's
  arguments (split count, split length, table stride) hold for any context; each row's real
  context length is read from the buffer on the device.

The graph object is an interface (``GraphBackend``) so that the replay logic runs on the CPU in
tests: a fake "capture" keeps the callable, a fake "replay" runs it again with no arguments,
which gives the right tokens only if every input really went through the static buffers.

The runner holds its captured steps, so the captured steps never hold the runner (nor does
anything they capture): they keep the model, the step buffers and the KV cache they read. With
no reference cycle, an engine's weights and KV pool are freed by reference counting the moment
it is dropped, not whenever the garbage collector next runs; on a GPU the next engine in the
process sizes its KV pool from the memory left free. The capture itself runs with the garbage
collector off (``no_collection_while_capturing``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from unittest import mock

import torch

from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.sampling_params import SamplingParams
from kernels import AttentionMetadata
from workers.graphs.graph_shapes import capture_sizes, padded_batch_size

if TYPE_CHECKING:
    from workers.step_buffers import StepBuffers

logger = logging.getLogger(__name__)


class Runner(Protocol):
    """What a capture reads of the model runner (workers.model_runner.Runner)."""

    device: torch.device
    enforce_eager: bool
    max_cudagraph_capture_size: int
    buffers: StepBuffers
    model: Any
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]

    def prepare_inputs(self, requests: list[ScheduledRequest],
                       table_width: int | None = None) -> Any: ...


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """Run ``fn`` under capture; returns (graph handle, its static output)."""
        ...

    def replay(self, graph: Any) -> None: ...


class CudaGraphBackend:
    """torch.cuda.CUDAGraph, one memory pool shared by every size (captured largest first, as
    vLLM does, so the smaller ones fit in what the largest left)."""

    def __init__(self, device: torch.device, warmup_runs: int = 2) -> None:
        self.device = device
        self.warmup_runs = warmup_runs
        self.pool = torch.cuda.graph_pool_handle()
        self.captures = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        # Warm-up runs on a side stream before capture (cuBLAS workspaces, lazy inits), as
        # torch.cuda.graphs documents.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(self.warmup_runs):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with self._cache_flush_once(), torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.captures += 1
        return graph, out

    def _cache_flush_once(self) -> contextlib.AbstractContextManager[Any]:
        """torch.cuda.graph empties the device and pinned-host caches before every capture;
        the startup captures thousands of pieces in a row, so only the first does (vLLM does
        the same)."""
        if self.captures == 0:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(torch.cuda, "empty_cache", _no_op))
        stack.enter_context(mock.patch.object(torch._C, "_host_emptyCache", _no_op,
                                              create=True))
        return stack

    def replay(self, graph: Any) -> None:
        graph.replay()


def _no_op() -> None:
    pass


@dataclass
class _Captured:
    graph: Any
    output: torch.Tensor


@contextlib.contextmanager
def no_collection_while_capturing() -> Iterator[None]:
    """Collect once, then no automatic garbage collection until the capture ends (as vLLM
    does): a collection that ran mid-capture could free a tensor or a graph a capture in
    progress still refers to. Every object alive now is frozen (moved out of the collector's
    reach) as well, unless something else froze objects before, whose freeze an unfreeze here
    would undo; the collector is off either way. Restored on every exit, a failed capture's
    included."""
    gc.collect()
    was_enabled = gc.isenabled()
    freezing = gc.get_freeze_count() == 0
    if freezing:
        gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if freezing:
            gc.unfreeze()
        if was_enabled:
            gc.enable()


class CapturedSteps:
    """What both kinds of captured step (DecodeGraphs, workers.graphs.piecewise_graphs) share: the
    sizes, the backend, the step buffers' generation the captures read, and the counters.

    It keeps the model and the step buffers it reads, never the runner (which holds it): see
    the module docstring."""

    kind = "captured"  # which steps, for the log

    def __init__(self, runner: Runner, sizes: Sequence[int], backend: GraphBackend) -> None:
        self.model = runner.model
        self.buffers = runner.buffers
        self.sizes = sorted(sizes)
        self.backend = backend
        self.graphs: dict[int, Any] = {}
        # The buffers' generation the graphs read (a grown buffer is a new address).
        self.generation = -1
        self.capture_seconds = 0.0
        self.replays = 0

    def _capture_one(self, fn: Callable[[], torch.Tensor],
                     what: str) -> tuple[Any, torch.Tensor]:
        try:
            return self.backend.capture(fn)
        except Exception as exc:
            raise RuntimeError(f"CUDA graph capture failed at {what}: {type(exc).__name__}: "
                               f"{exc} (--enforce-eager runs every step without graphs)"
                               ) from exc

    def _check_buffers_held_still(self) -> None:
        if self.buffers.generation != self.generation:
            raise RuntimeError("the step buffers grew while capturing CUDA graphs")

    def buffers_moved(self) -> bool:
        """Whether the step buffers grew after the capture, so the graphs read old addresses:
        a step outgrew the limits the buffers were sized for (a bug upstream). The graphs are
        dropped, and from then on those steps run eager (slower, still correct)."""
        if self.buffers.generation == self.generation:
            return False
        if self.graphs:
            logger.warning("CUDA graphs: the step buffers grew after the capture; %s steps run "
                           "eager from now on", self.kind)
            self.graphs.clear()
        return True


class DecodeGraphs(CapturedSteps):
    kind = "decode"

    def __init__(self, runner: Runner, sizes: Sequence[int], backend: GraphBackend,
                 max_model_len: int) -> None:
        super().__init__(runner, sizes, backend)
        self.max_model_len = max_model_len
        # The pool the graphs write to: the final one (the pool is sized before the capture).
        self.kv_caches = runner.kv_caches

    @property
    def table_width(self) -> int | None:
        """How wide ``prepare_inputs`` writes the block tables of a replayed step. The Triton
        kernels read no column past a row's context, so the columns past the step's longest
        table may hold anything (no upload of max_model_len's width per row: 8 MB a step for
        128 rows of a 128k context). The PyTorch kernels gather the whole captured width, so
        there every column must be a block id of the pool (zeros past each table)."""
        if self.model.kernels.name == "triton":
            return None
        return self.buffers.max_blocks

    def _static_metadata(self, size: int) -> AttentionMetadata:
        buffers = self.buffers

        def metadata(slot_mapping: torch.Tensor, block_tables: torch.Tensor) -> AttentionMetadata:
            return AttentionMetadata(
                slot_mapping=slot_mapping[:size], num_decodes=size,
                decode_block_tables=block_tables[:size],
                decode_context_lens=buffers.context_lens[:size],
                prefill_query_lens=[], prefill_context_lens=[], prefill_block_tables=[],
                decode_max_context=buffers.max_blocks * buffers.block_size,
                # Every slot past 1 is masked by each row's length (read on the device).
                decode_min_context=1)

        meta = metadata(buffers.slot_mapping, buffers.block_tables)
        # The other KV cache groups' (engine.core.kv_groups): their own slots and tables.
        meta.other_groups = [metadata(slots, tables) for slots, tables
                             in zip(buffers.group_slot_mappings, buffers.group_block_tables)]
        return meta

    def _forward(self, size: int) -> Callable[[], torch.Tensor]:
        # Locals only: a graph (the CPU stand-in's keeps this function) must not hold this
        # object, which holds the graphs.
        model, buffers, kv_caches = self.model, self.buffers, self.kv_caches
        meta = self._static_metadata(size)

        def forward() -> torch.Tensor:
            # The plans the kernels derive from the metadata are built inside the pass (and so
            # captured), never carried over from an earlier run.
            meta.clear_derived()
            return model.forward(buffers.input_ids[:size], buffers.positions[:size], meta,
                                 kv_caches)

        return forward

    def capture(self, runner: Runner) -> float:
        """Capture every size, largest first; returns the seconds it took. ``runner`` writes
        the dummy steps' inputs; it is not kept."""
        started = time.perf_counter()
        buffers = self.buffers
        # Room for the largest size, and tables as wide as the longest sequence: the captured
        # launches cover every context up to it.
        largest = self.sizes[-1]
        blocks = -(-self.max_model_len // buffers.block_size)
        buffers.reserve(largest, largest, blocks)
        self.generation = buffers.generation
        with no_collection_while_capturing():
            for size in sorted(self.sizes, reverse=True):
                # Dummy decodes at position 0 over block 0, as the kernel warm-up writes:
                # nothing reads what they leave there before a request owns the block. The
                # tables are zeroed at full width once, so no column holds anything but a
                # block id.
                runner.prepare_inputs(_dummy_decodes(size), table_width=buffers.max_blocks)
                graph, output = self._capture_one(self._forward(size), f"decode batch {size}")
                self.graphs[size] = _Captured(graph, output)
        self._check_buffers_held_still()
        self.capture_seconds = time.perf_counter() - started
        return self.capture_seconds

    def size_for(self, scheduler_output: SchedulerOutput) -> int | None:
        """The padded size this step replays at, or None: it runs eager (a prefill or a
        resumed chunk in it, a vote to cast, more decodes than the largest size, or buffers
        that moved since the capture)."""
        requests = scheduler_output.requests
        if self.buffers_moved():
            return None
        if (scheduler_output.preemptible or not requests
                or any(len(r.token_ids) != 1 or r.resume for r in requests)):
            return None
        size = padded_batch_size(len(requests), self.sizes)
        return size if size in self.graphs else None

    def replay(self, size: int) -> torch.Tensor:
        """Run the captured step of ``size`` over what the buffers hold; its hidden states."""
        captured = self.graphs[size]
        self.backend.replay(captured.graph)
        self.replays += 1
        return captured.output


def padded(requests: list[ScheduledRequest], size: int) -> list[ScheduledRequest]:
    """``requests`` and ``size - len(requests)`` repeats of the last one (padding rows)."""
    return requests + [requests[-1]] * (size - len(requests))


def _dummy_decodes(size: int) -> list[ScheduledRequest]:
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    return [ScheduledRequest(req_id=f"graph-capture-{i}", token_ids=[0], start_pos=0,
                             block_ids=[0], sample=False, sampling_params=greedy)
            for i in range(size)]


# Test hook: on a machine without CUDA, "capture" graphs with EagerReplayBackend, so that the
# engine's graph paths (static buffers, padding, piecewise steps with the vote between pieces)
# run end to end on the CPU. Set in the environment, so spawned TP workers inherit it.
FAKE_GRAPHS_ENV = "SLOSERVE_TEST_FAKE_CUDA_GRAPHS"


class EagerReplayBackend:
    """The CPU stand-in for CUDA graphs: "capture" keeps the function and a copy of its output
    (a graph's output lives at a fixed address), "replay" calls the function again with no
    arguments and writes its result there. A replay gives the right result only if every input
    went through the static buffers the capture closed over, which is what tests check."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        out = fn().clone()
        return (fn, out), out

    def replay(self, graph: Any) -> None:
        fn, out = graph
        out.copy_(fn())


def select_graph_backend(runner: Runner, tp_size: int = 1) -> GraphBackend | None:
    """How this runner captures graphs, or None where graphs are off: --enforce-eager, not on
    CUDA (unless FAKE_GRAPHS_ENV asks for the CPU stand-in), or tensor parallel (the
    all-reduces inside a captured step are not yet tested on GPUs)."""
    if runner.enforce_eager:
        logger.info("CUDA graphs: off (--enforce-eager)")
        return None
    if os.environ.get(FAKE_GRAPHS_ENV) == "1":
        logger.warning("CUDA graphs: %s=1, replaying captured steps eagerly (a test stand-in)",
                       FAKE_GRAPHS_ENV)
        return EagerReplayBackend()
    if runner.device.type != "cuda":
        return None
    if tp_size > 1:
        logger.info("CUDA graphs: off with tensor parallelism (every step runs eager)")
        return None
    if not all(getattr(module, "capturable", True) for module in runner.model.modules()):
        logger.info("CUDA graphs: off: the experts run in PyTorch here (not the fused Triton "
                    "kernel), reading their per-expert token counts on the host")
        return None
    return CudaGraphBackend(runner.device)


def capture_decode_graphs(runner: Runner, max_num_seqs: int, max_model_len: int,
                          tp_size: int = 1,
                          backend: GraphBackend | None = None) -> DecodeGraphs | None:
    """Capture the decode graphs at startup, after the kernel warm-up; None where graphs are
    off (``select_graph_backend``, unless a test passes a backend; --enforce-eager always
    wins)."""
    if runner.enforce_eager:
        return None
    if backend is None:
        backend = select_graph_backend(runner, tp_size)
        if backend is None:
            return None
    sizes = capture_sizes(max_num_seqs, runner.max_cudagraph_capture_size)
    graphs = DecodeGraphs(runner, sizes, backend, max_model_len)
    seconds = graphs.capture(runner)
    logger.info("CUDA graphs: captured %d decode batch sizes (%d..%d) in %.2f s", len(sizes),
                sizes[0], sizes[-1], seconds)
    return graphs
