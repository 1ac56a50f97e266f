"""Turns a SchedulerOutput into model inputs, runs the forward pass and samples.

Across steps the runner keeps the KV cache contents and each request's block table
(workers.block_tables: a step sends only what changed of a table); every scheduled request carries
its token slice, so a step that is abandoned or rolled back leaves nothing behind here that needs
undoing (the next step's table updates start where the scheduler's rollback left the tables).

A step is launched (``ModelRunner.launch``) and read back later (workers.launched_step): on a
GPU nothing in between waits for the device, so the host can launch the next step while this one
runs (async scheduling). The one thing a step leaves for the next is its sampled ids, on the
device: a decode scheduled before its last token was read back (``last_token_pending``) takes
that token from them.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from engine.core.kv_groups import layer_groups
from engine.logprobs import LogprobsLists
from engine.sampling_params import SamplingParams
from engine.core.scheduler_output import (ModelRunnerOutput, ScheduledRequest, SchedulerOutput,
                                    StepStatus)
from kernels import AttentionMetadata, select_backend
from engine.model_folder import load_hf_config
from engine.worker_messages import WorkerConfig
from kernels.variants import KernelWarmup, recording
from workers.startup import serving_startup
from workers.startup.kernel_warmup import warm_up_graph_paths, warm_up_kernels
from workers.kv_cache import allocate_kv_caches, num_kv_blocks, resized_kv_caches
from workers.layers.cpu_bf16_weights import bf16_weights_available, hold_weights_in_bf16
from workers.layers.cpu_prepack import prepack_available, prepack_linear_weights
from workers.models import build_model
from workers.quantization import describe_weights
from workers.models import LayerJoin
from workers.preemption.slo_preempt_vote import SLOPreemptVote, StepSLOPreempted, discarded_share
from workers.preemption.run_ahead import RunAheadLimit
from workers.graphs.cuda_graphs import DecodeGraphs, capture_decode_graphs, padded, select_graph_backend
from workers.graphs.cpu_decode_pass import CpuDecodePass, plan_decode_pass
from workers.graphs.piecewise_graphs import PiecewiseGraphs, capture_piecewise_graphs
from workers.startup.startup_report import ServingStartup
from workers.block_tables import BlockTables
from workers.host_transfer import upload_tensor
from workers.launched_step import LaunchedStep, StepSamples, StepTimer, sample_rows
from workers.step_buffers import StepBuffers, StepLimits
from workers.preemption.suspension import HeldChunks
from workers.sample.logits_processors import TokenHistory
from workers.sample.logprobs import logprobs_of
from workers.sample.sampler import PendingSample, Sampler
from workers.startup.weight_loader import init_dummy_weights, load_weights

logger = logging.getLogger(__name__)

# Prompt rows scored per LM-head call: bounds the [rows, vocab] float32 logits held at once
# (256 x 128k vocab = 128 MiB).
PROMPT_LOGPROB_ROWS = 256


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    # Each token's row of the rotary table: its position, past the LongRoPE offset for a
    # long-regime request (workers.layers.rotary).
    positions: torch.Tensor
    attn_meta: AttentionMetadata
    # Rows of the hidden states to sample from, and the requests they belong to.
    logits_indices: torch.Tensor
    sampled: list[ScheduledRequest]
    # Chunks resuming a suspended pass (the batch's last prefills, in order of their layer).
    joins: list[LayerJoin]
    # Every prefill chunk with its first row in the batch (for suspending the pass).
    prefill_rows: list[tuple[ScheduledRequest, int]]
    # Chunks whose prompt tokens are scored, with their first row.
    prompt_logprob_rows: list[tuple[ScheduledRequest, int]] = field(default_factory=list)
    # Each sequence's query tokens and context (including them), in batch order, on the host:
    # what a captured step's attention layout is written from (workers.graphs.attention_layout).
    query_lens: np.ndarray | None = None
    context_lens: np.ndarray | None = None


class ModelRunner:
    def __init__(self, config: WorkerConfig, device: torch.device, rank: int = 0,
                 tp_group: dist.ProcessGroup | None = None) -> None:
        """This rank's shard of the model, built as ``config`` says (workers.worker builds one
        per rank), with a KV pool of ``config.num_blocks`` blocks (none until
        ``resize_kv_pool`` where the workers measure the pool). Input buffers are sized for the
        scheduler's largest step. ``rank`` 0 samples; the others only join the collectives."""
        settings = config.engine.model
        # vLLM's --enforce-eager, and the largest decode batch and step (tokens) captured
        # (workers.graphs.cuda_graphs, workers.graphs.piecewise_graphs read them).
        self.enforce_eager = settings.enforce_eager
        self.max_cudagraph_capture_size = settings.max_cudagraph_capture_size
        self.device = device
        self.tp_size = config.tp_size
        # Startup passes (kernel warm-up, graph capture) cover steps this long and this wide.
        self.max_model_len = config.max_model_len
        self.max_num_seqs = config.engine.scheduler.max_num_seqs
        # Only the rank that reports results samples; the others still join the LM head's
        # collective.
        self.sample = rank == 0
        self.block_size = block_size = config.engine.cache.block_size
        dtype = getattr(torch, config.dtype)
        hf_config = load_hf_config(str(settings.model))
        self.model = build_model(hf_config, dtype, device, tp_rank=rank, tp_size=config.tp_size,
                                 tp_group=tp_group, quantization=settings.quantization)
        if settings.load_format == "dummy":
            init_dummy_weights(self.model, settings.seed + rank)
        else:
            load_weights(self.model, str(settings.model))
        if self.model.quant_config is not None:
            logger.info("%s", describe_weights(self.model))
        # LongRoPE: where the rotary table's long-regime rows start (workers.layers.rotary).
        self.long_rope_offset: int | None = self.model.model.rotary_emb.long_offset
        self.model.eval()
        if prepack_available(device, dtype):
            packed = prepack_linear_weights(self.model)
            logger.info("prepacked %d linear weights for oneDNN", packed)
        if bf16_weights_available(device, dtype):
            hold_weights_in_bf16(self.model)
        self.model.use_kernels(select_backend(device, settings.attention_backend,
                                              settings.fused_ops))
        # Decode-only steps through every layer in one compiled call, on a CPU serving a model
        # whose projections have bfloat16 copies (workers.graphs.cpu_decode_pass); None: layered.
        self.decode_pass: CpuDecodePass | None = (
            plan_decode_pass(self.model) if device.type == "cpu" and not self.enforce_eager
            else None)
        # A pair of cache tensors per position within a KV cache group, shared by the layers at
        # that position of every group (engine.core.kv_groups, workers.kv_cache).
        groups = self.model.kv_cache_groups
        self.kv_caches = allocate_kv_caches(self.model.num_layers, config.num_blocks or 0,
                                            block_size, self.model.num_kv_heads,
                                            self.model.head_dim, dtype, device,
                                            [p for _, p in layer_groups(groups)])
        self.sampler = Sampler(settings.seed, device)
        self.buffers = StepBuffers(device, StepLimits(config.engine.scheduler.max_num_batched_tokens,
                                                      self.max_num_seqs, self.max_model_len),
                                   block_size, len(groups))
        # Each request's block table, updated by what each step sends (workers.block_tables),
        # and the other KV cache groups' tables.
        self.block_tables = BlockTables(self.buffers.max_blocks, rows=self.max_num_seqs + 1)
        self.group_block_tables = [BlockTables(self.buffers.max_blocks,
                                               rows=self.max_num_seqs + 1, group=g)
                                   for g in range(1, len(groups))]
        # Captured decode steps (workers.graphs.cuda_graphs) and the pieces of steps with prefill tokens
        # (workers.graphs.piecewise_graphs), set at startup on CUDA; None: those steps run eager.
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        # What the startup warm-up compiled (workers.startup.kernel_warmup; None: not run, or not Triton).
        self.kernel_warmup: KernelWarmup | None = None
        # What the startup before serving cost (workers.startup.serving_startup); None until it ran.
        self.startup_report: ServingStartup | None = None
        self.suspended = HeldChunks()
        # Installed by the worker when mid-forward preemption is on; consulted only on steps
        # the scheduler marked preemptible (decode-only steps never vote).
        self.vote: SLOPreemptVote | None = None
        # On a GPU the host must not run ahead of the device by more than a layer in a
        # preemptible step, or its votes come too early to stop anything, and a stop leaves the
        # queued layers for the urgent step to wait behind.
        self.run_ahead = RunAheadLimit() if device.type == "cuda" else None
        # The last launched step's sampled ids, still on the device: the input tokens of the
        # decodes scheduled ahead of them (async scheduling). None after a step that sampled
        # nothing: no decode may then be scheduled ahead.
        self._last_samples: StepSamples | None = None

    @property
    def num_kv_blocks(self) -> int:
        return num_kv_blocks(self.kv_caches)

    def resize_kv_pool(self, num_blocks: int) -> None:
        """A pool of ``num_blocks`` blocks in place of the current one (sized once the weights
        are loaded: workers.startup.kv_memory); what the old pool held is gone."""
        self.kv_caches = resized_kv_caches(self.kv_caches, num_blocks)

    def install_vote(self, vote: SLOPreemptVote | None) -> None:
        """The attention-op vote of mid-forward preemption (None: steps are never stopped)."""
        self.vote = vote

    def prepare_for_serving(self) -> None:
        """Once, after the KV pool has its final size: compile every Triton kernel variant (no
        compile may stall serving), then capture the CUDA graphs over the compiled kernels: full
        graphs for decode batches, pieces between the attention ops for steps with prefill
        tokens, and warm up the kernels their paths launch. Every TP rank runs the same steps,
        so their collectives match. Sets ``startup_report`` (workers.startup.serving_startup)."""
        try:
            self._warm_up_and_capture()
        finally:
            # The startup steps' made-up requests leave block tables behind: none is served.
            for tables in (self.block_tables, *self.group_block_tables):
                tables.release(list(tables.row_of))

    def _warm_up_and_capture(self) -> None:
        self.startup_report = None
        max_model_len, max_num_seqs = self.max_model_len, self.max_num_seqs
        started = time.perf_counter()
        self.kernel_warmup = warm_up_kernels(self, max_model_len, max_num_seqs)
        warmup_s = time.perf_counter() - started
        backend = select_graph_backend(self, self.tp_size)
        if backend is None:
            self.startup_report = serving_startup.without_graphs(warmup_s)
            return
        with serving_startup.CaptureCost(self.device) as cost, recording() as captured:
            self.graphs = capture_decode_graphs(self, max_num_seqs, max_model_len,
                                                backend=backend)
            self.piecewise = capture_piecewise_graphs(self, self.buffers.max_tokens, backend)
        if self.kernel_warmup is not None:
            started = time.perf_counter()
            self.kernel_warmup = warm_up_graph_paths(self, self.kernel_warmup, max_model_len,
                                                     max_num_seqs, captured)
            warmup_s += time.perf_counter() - started
        self.startup_report = cost.report(warmup_s, self.graphs, self.piecewise)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step and wait for it."""
        return self.launch(scheduler_output).result()

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        """Queue the step on the device and return without waiting for it (on a GPU; a CPU
        computes it here): its handle's ``result()`` waits. Steps run in launch order, and a
        decode scheduled ahead (``last_token_pending``) reads its input token from the step
        launched before it, on the device."""
        timer = StepTimer(self.device)
        started = timer.started
        self.suspended.free(scheduler_output.free_suspended)
        for tables in (self.block_tables, *self.group_block_tables):
            tables.release(scheduler_output.released_req_ids)
        if not scheduler_output.requests:
            # The engine had nothing to compute but suspended chunks or block tables to free
            # (every rank frees its own copy; no collective is entered).
            return LaunchedStep(ModelRunnerOutput(step_id=scheduler_output.step_id))
        requests = scheduler_output.requests
        graphs, piecewise = self.graphs, self.piecewise
        graph_size = graphs.size_for(scheduler_output) if graphs is not None else None
        piece_size = None
        if graph_size is None and piecewise is not None:
            piece_size = piecewise.size_for(scheduler_output)
        # This step's inputs take the previous step's samples; from here on those are spent
        # (a step that fails before it samples leaves none for a decode scheduled after it).
        previous, self._last_samples = self._last_samples, None
        if graph_size is None:
            # Pieces holding the attention write every row's KV slot: the padding's are -1.
            slot_rows = piece_size if piece_size is not None and piecewise.holds_attention \
                else None
            inputs = self.prepare_inputs(requests, previous=previous, slot_rows=slot_rows)
            if piece_size is not None and piecewise.buffers_moved():
                piece_size = None  # the step grew the buffers the pieces read: it runs eager
        else:
            # The padding rows repeat the last decode (workers.graphs.cuda_graphs); only the real
            # rows are sampled.
            inputs = self.prepare_inputs(padded(requests, graph_size),
                                         table_width=graphs.table_width, previous=previous)
            real = sum(r.sample for r in requests)
            inputs.sampled, inputs.logits_indices = (inputs.sampled[:real],
                                                     inputs.logits_indices[:real])
        resumed_layers = {r.req_id: self.suspended.layer_of(r)
                          for r in scheduler_output.requests if r.resume}
        vote = self.vote if scheduler_output.preemptible else None
        if vote is not None:
            vote.step_id = scheduler_output.step_id
            vote.discarded_share = discarded_share(scheduler_output)
            if self.run_ahead is None:
                self.model.before_attention = vote
            else:
                self.model.before_attention = self.run_ahead.pace(
                    vote, on_window=lambda window: setattr(vote, "progress_lag", window))
        try:
            if graphs is not None and graph_size is not None:
                hidden = graphs.replay(graph_size)
            elif piecewise is not None and piece_size is not None:
                hidden = piecewise.run(piece_size, inputs.input_ids.shape[0], inputs.attn_meta,
                                       self.kv_caches, inputs.query_lens, inputs.context_lens)
            elif self._runs_decode_pass(inputs):
                hidden = self.decode_pass.run(inputs.input_ids, inputs.positions,
                                              inputs.attn_meta, self.kv_caches)
            else:
                hidden = self.model.forward(inputs.input_ids, inputs.positions,
                                            inputs.attn_meta, self.kv_caches, inputs.joins)
        except StepSLOPreempted as stop:
            suspended: list[str] = []
            if scheduler_output.suspend_on_unwind:
                suspended = self.suspended.suspend(stop, inputs.prefill_rows)
            return LaunchedStep(ModelRunnerOutput(
                step_id=scheduler_output.step_id, status=StepStatus.SLO_PREEMPTED,
                slo_preempted_layer=stop.layer, unwound_layers=[stop.layer],
                suspended_req_ids=suspended, resumed_layers=resumed_layers,
                execute_seconds=time.perf_counter() - started))
        finally:
            self.model.before_attention = None
        self.suspended.consume([r for r in scheduler_output.requests if r.resume])
        if vote is not None:
            vote.finish()
        output = ModelRunnerOutput(step_id=scheduler_output.step_id,
                                   resumed_layers=resumed_layers)
        # Every rank computes logits (the LM head may be a collective); one samples.
        prompt_logprobs = self._score_prompts(hidden, inputs.prompt_logprob_rows)
        if inputs.sampled:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
        pending: PendingSample | None = None
        if inputs.sampled and self.sample:
            pending = self._launch_sample(logits, inputs.sampled)
            self._last_samples = StepSamples(
                {r.req_id: row for row, r in enumerate(inputs.sampled)}, pending.tokens)
        if self.sample:
            output.prompt_logprobs = prompt_logprobs
        # The step's time feeds the TTFT predictor: it must include the device's work, not only
        # the launches; timed by events on a GPU, so that nothing here waits for the device.
        timer.launched()
        return LaunchedStep(output, inputs.sampled, pending, timer)

    def _runs_decode_pass(self, inputs: ModelInputs) -> bool:
        """Whether the CPU decode pass runs this step: a decode-only step it serves, with no
        hook to call before the attention ops (a step that votes runs layer by layer)."""
        return (self.decode_pass is not None and self.model.before_attention is None
                and not inputs.joins
                and self.decode_pass.serves(inputs.input_ids.shape[0], inputs.attn_meta))

    def _score_prompts(self, hidden: torch.Tensor,
                       chunks: list[tuple[ScheduledRequest, int]]) -> dict[str, LogprobsLists]:
        """Prompt logprobs: each chunk's rows against the prompt tokens after them, from the
        raw logits, in slices so that a long chunk never holds [tokens, vocab] at once."""
        scored: dict[str, LogprobsLists] = {}
        for req, first_row in chunks:
            targets = req.prompt_logprob_targets
            k = req.sampling_params.prompt_logprobs or 0
            lists = LogprobsLists()
            for begin in range(0, len(targets), PROMPT_LOGPROB_ROWS):
                end = min(begin + PROMPT_LOGPROB_ROWS, len(targets))
                logits = self.model.compute_logits(hidden[first_row + begin:first_row + end])
                ids = torch.tensor(targets[begin:end], dtype=torch.long, device=logits.device)
                lists.extend(logprobs_of(logits, ids, k))
            scored[req.req_id] = lists
        return scored

    def _launch_sample(self, logits: torch.Tensor,
                       requests: list[ScheduledRequest]) -> PendingSample:
        """Queue the draws of the requests' tokens (and logprobs); only the rank that samples
        gets here, so a failure cannot desynchronise the group."""
        params: list[SamplingParams] = [r.sampling_params for r in requests]
        indices = [r.num_output_tokens for r in requests]
        histories = [TokenHistory(r.prompt_token_ids, r.output_token_ids, r.blocked_token_ids,
                                  r.allowed_token_bitmask) for r in requests]
        return self.sampler.launch(logits, params, indices, histories)

    def prepare_inputs(self, requests: list[ScheduledRequest],
                       table_width: int | None = None,
                       previous: StepSamples | None = None,
                       slot_rows: int | None = None) -> ModelInputs:
        """``table_width``: write every block table row this wide (a captured graph's launches
        read the buffer's full width); default: as wide as the longest table of the step.
        ``previous``: the samples of the step launched before, which feed the decodes
        scheduled ahead (``last_token_pending``). ``slot_rows``: write this many KV slots, the
        rows past the step's tokens -1 (padding a captured step writes nowhere)."""
        # The attention kernels expect decodes (one query token) first, then prefill chunks;
        # chunks resuming a suspended pass go last, in order of the layer they join at, so that
        # the tokens active at any layer are a prefix of the batch.
        decodes = [r for r in requests if len(r.token_ids) == 1 and not r.resume]
        fresh = [r for r in requests if len(r.token_ids) > 1 and not r.resume]
        resumed = sorted((r for r in requests if r.resume), key=self.suspended.layer_of)
        prefills = fresh + resumed
        ordered = decodes + prefills
        # Built with numpy over the whole batch: per-request tensor ops cost ~20 us each on the
        # host, and the host's time per step is the device's idle time between decode steps.
        num_seqs = len(ordered)
        lengths = np.fromiter((len(r.token_ids) for r in ordered), np.int64, num_seqs)
        starts = np.fromiter((r.start_pos for r in ordered), np.int64, num_seqs)
        ends = np.cumsum(lengths)
        first_rows = ends - lengths
        num_tokens = int(ends[-1])
        seq_of_token = np.repeat(np.arange(num_seqs), lengths)
        positions = starts[seq_of_token] + (np.arange(num_tokens) - first_rows[seq_of_token])
        # Every sequence's table, decodes first, padded with block 0 to the longest (one upload
        # for all), or to ``table_width``.
        tables, widths = self.block_tables.gather(ordered, table_width)
        bs = self.block_size
        slots = tables[seq_of_token, positions // bs] * bs + positions % bs
        # The rotary table's rows: a LongRoPE long-regime request's from the long rows.
        rotary_rows = positions
        if self.long_rope_offset is not None:
            long_rope = np.fromiter((r.long_rope for r in ordered), bool, num_seqs)
            if long_rope.any():
                rotary_rows = positions + long_rope[seq_of_token] * self.long_rope_offset
        input_ids = np.fromiter(
            itertools.chain.from_iterable(r.token_ids for r in ordered if not r.resume), np.int64)
        # Decodes scheduled ahead (the padding rows of a graph repeat one, and count too): their
        # token is taken from the previous step's samples once the ids are on the device.
        # PENDING_TOKEN never reaches the embedding (an index error on a CPU, a device assert
        # on a GPU), whatever happens to the step after this.
        pending = [i for i, r in enumerate(ordered) if r.last_token_pending]
        if pending:
            pending_rows = first_rows[pending]
            pending_sources = sample_rows(previous, [ordered[i] for i in pending])
            input_ids[pending_rows] = 0
        sampled = [r for r in ordered if r.sample]
        logits_indices = ends[[i for i, r in enumerate(ordered) if r.sample]] - 1
        row_of = first_rows.tolist()
        prefill_rows = [(r, row_of[i]) for i, r in enumerate(ordered) if len(r.token_ids) > 1]
        prompt_logprob_rows = [(r, row_of[i]) for i, r in enumerate(ordered)
                               if r.prompt_logprob_targets]

        num_decodes = len(decodes)
        context_lens = starts[:num_decodes] + 1
        # Every device input goes into the runner's persistent buffers (workers.step_buffers):
        # fixed addresses for CUDA graphs, and no allocation per step.
        buffers = self.buffers
        buffers.reserve(num_tokens, num_seqs, tables.shape[1])
        upload = buffers.upload
        device_tables = upload(buffers.block_tables, torch.from_numpy(tables))
        attn_meta = AttentionMetadata(
            slot_mapping=upload(buffers.slot_mapping, _padded_slots(slots, slot_rows)
                                )[:num_tokens],
            num_decodes=num_decodes,
            decode_block_tables=device_tables[:num_decodes],
            decode_context_lens=upload(buffers.context_lens, torch.from_numpy(context_lens)),
            prefill_query_lens=[len(r.token_ids) for r in prefills],
            prefill_context_lens=[r.start_pos + len(r.token_ids) for r in prefills],
            prefill_block_tables=[device_tables[num_decodes + i, :int(widths[num_decodes + i])]
                                  for i in range(len(prefills))],
            decode_max_context=int(context_lens.max()) if num_decodes else 0,
            decode_min_context=int(context_lens.min()) if num_decodes else 0,
            decode_context_list=context_lens.tolist(),
        )
        # The other KV cache groups' tables and slots over the same lengths (a table's entries
        # before its sliding window are never read).
        for g, group_tables in enumerate(self.group_block_tables):
            tables_g, widths_g = group_tables.gather(ordered, tables.shape[1])
            slots_g = tables_g[seq_of_token, positions // bs] * bs + positions % bs
            device_tables_g = upload(buffers.group_block_tables[g], torch.from_numpy(tables_g))
            attn_meta.other_groups.append(dataclasses.replace(
                attn_meta, slot_mapping=upload(buffers.group_slot_mappings[g],
                                               _padded_slots(slots_g, slot_rows))[:num_tokens],
                decode_block_tables=device_tables_g[:num_decodes],
                prefill_block_tables=[
                    device_tables_g[num_decodes + i, :int(widths_g[num_decodes + i])]
                    for i in range(len(prefills))],
                other_groups=[]))
        device_ids = upload(buffers.input_ids, torch.from_numpy(input_ids))
        if pending:
            assert previous is not None  # else _sample_rows raised
            # One upload of both index lists, one gather, in place in the buffer (a captured
            # graph reads the buffer): no read of the sampled ids on the host.
            index = upload_tensor(torch.from_numpy(np.stack(
                [pending_rows, np.asarray(pending_sources, dtype=np.int64)])), self.device)
            device_ids.index_copy_(0, index[0], previous.tokens.index_select(0, index[1]))
        return ModelInputs(
            input_ids=device_ids,
            positions=upload(buffers.positions, torch.from_numpy(rotary_rows)),
            attn_meta=attn_meta,
            logits_indices=upload(buffers.logits_indices, torch.from_numpy(logits_indices)),
            sampled=sampled,
            joins=[self.suspended.join_for(r) for r in resumed],
            prefill_rows=prefill_rows,
            prompt_logprob_rows=prompt_logprob_rows,
            query_lens=lengths,
            context_lens=starts + lengths,
        )


def _padded_slots(slots: np.ndarray, rows: int | None) -> torch.Tensor:
    """The step's KV slots, extended with -1 (written nowhere) to ``rows`` rows."""
    if rows is None or rows <= slots.size:
        return torch.from_numpy(slots)
    padded = np.full(rows, -1, dtype=np.int64)
    padded[:slots.size] = slots
    return torch.from_numpy(padded)
