"""Compile every Triton kernel variant at startup, so that no request waits on a compile.

Triton compiles a kernel variant the first time a launch needs it (about a second each on a GPU),
and every request in flight waits for it. The kernels keep what varies with the batch out of
their compile-time constants (see ``kernels.variants``), so what is left to compile depends on
the model and configuration only: one variant per kernel and call site, plus the two decode
paths (split across programs or not) when both are reachable. ``warm_up_kernels`` runs, once
the model and its KV cache exist and before any request, one dummy step per decode path
(``kernels.triton_attention.decode_variant_shapes``, the function the launch path's split
choice comes from), with a short prefill chunk in the first; a forward pass reaches every other
kernel and call site, the fused norm, rotary and SiLU·mul kernels among them.

The steps write only block 0 of the pool (every table lists block 0 only; nothing reads what
they leave there, since a context length bounds every read) and keep every sequence within
``max_model_len``. Every rank runs the same steps, so the tensor-parallel collectives match.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Protocol

import torch

from engine.core.scheduler_output import (ModelRunnerOutput, ScheduledRequest, SchedulerOutput,
                                          StepStatus)
from engine.sampling_params import SamplingParams
from kernels.variants import KernelWarmup, Variant, recording

logger = logging.getLogger(__name__)

DECODE_KERNEL = "_paged_attention_kernel"
MERGE_KERNEL = "_merge_splits_kernel"


class WarmupRunner(Protocol):
    """What the warm-up reads of the model runner (workers.model_runner.ModelRunner, which
    runs the warm-up from its ``prepare_for_serving``)."""

    device: torch.device
    block_size: int
    model: Any
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


def warmup_steps(decode_shapes: dict[bool, tuple[int, int]], max_model_len: int,
                 block_size: int, prefill_in_every_step: bool = False) -> list[SchedulerOutput]:
    """One step per decode path (``decode_shapes``: split -> (decodes, context length)), the
    first (or, with ``prefill_in_every_step``, each) with a two-token prefill chunk (one token
    would be scheduled as a decode)."""
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    steps: list[list[ScheduledRequest]] = []
    for split in sorted(decode_shapes):  # unsplit first: it takes the prefill
        num_decodes, context = decode_shapes[split]
        blocks = [0] * -(-context // block_size)
        steps.append([ScheduledRequest(
            req_id=f"warmup-decode-{split:d}-{i}", token_ids=[0], start_pos=context - 1,
            block_ids=blocks, sample=True, sampling_params=greedy) for i in range(num_decodes)])
    if max_model_len >= 2:
        if not steps:
            steps.append([])
        for requests in steps if prefill_in_every_step else steps[:1]:
            requests.append(ScheduledRequest(req_id="warmup-prefill", token_ids=[0, 0],
                                             start_pos=0, block_ids=[0], sample=True,
                                             sampling_params=greedy))
    return [SchedulerOutput(step_id=0, requests=requests) for requests in steps if requests]


def warm_up_kernels(runner: WarmupRunner, max_model_len: int,
                    max_num_seqs: int) -> KernelWarmup | None:
    """Launch every Triton kernel variant the runner's steps can need; None (nothing run) when
    the runner does not use the Triton kernels."""
    if runner.model.kernels.name != "triton":
        return None
    if not runner.kv_caches or runner.kv_caches[0][0].shape[0] < 1:
        # The engine refuses such a pool next, naming what to change; nothing to warm up on.
        logger.warning("the KV pool is empty: Triton kernels not warmed up")
        return None
    shapes, steps = _plan(runner, max_model_len, max_num_seqs)
    started = time.perf_counter()
    with recording() as seen:
        run_steps(runner, steps)
        warm_up_experts(runner.model)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    warmup = KernelWarmup(variants=frozenset(seen), seconds=time.perf_counter() - started,
                          steps=len(steps), compiled=not _interpreted())
    missing = missing_decode_paths(warmup.variants, shapes)
    if missing:
        # A bug in this module (the steps no longer take the paths they were built for): serving
        # would compile them on first use.
        logger.warning("the kernel warm-up did not launch %s", ", ".join(missing))
    logger.info("Triton kernels: %d variants %s at startup in %.2f s (%s)", len(warmup.variants),
                "compiled" if warmup.compiled else "run in the interpreter", warmup.seconds,
                describe(warmup.variants))
    return warmup


def warm_up_experts(model: Any) -> None:
    """Every variant of the fused experts kernel, for a mixture-of-experts model (every layer's
    experts share one shape, dtype and top-k, so the first layer's stand for all). The kernel
    multiplies weights of the model's dtype (quantized experts hand it dequantized ones): a
    layer's first top-k experts in that dtype are all a launch needs."""
    from kernels import triton_moe

    for module in model.modules():
        experts = getattr(module, "experts", None)
        # Qwen-MoE and Mixtral name their router `gate`, gpt-oss `router`.
        router = getattr(module, "gate", None) or getattr(module, "router", None)
        if getattr(experts, "fused_experts", None) is None or router is None:
            continue
        top_k = router.top_k
        w13, w2 = experts.w13_weight[:top_k], experts.w2_weight[:top_k]
        if w13.dtype != model.dtype:
            w13, w2 = (torch.zeros(w.shape, dtype=model.dtype, device=w.device)
                       for w in (w13, w2))
        # gpt-oss's experts launch their own variant (biases, the clamped SwiGLU).
        triton_moe.warm_up_experts(w13, w2, top_k, **experts.fused_options(slice(top_k)))
        return


def _plan(runner: WarmupRunner, max_model_len: int, max_num_seqs: int,
          prefill_in_every_step: bool = False
          ) -> tuple[dict[bool, tuple[int, int]], list[SchedulerOutput]]:
    from kernels import triton_attention

    shapes = triton_attention.decode_variant_shapes(
        runner.model.num_kv_heads, runner.block_size, max_model_len, max_num_seqs,
        triton_attention.target_programs(runner.device))
    return shapes, warmup_steps(shapes, max_model_len, runner.block_size,
                                prefill_in_every_step)


def run_steps(runner: WarmupRunner, steps: list[SchedulerOutput]) -> None:
    for step in steps:
        output = runner.execute(step)
        if output.status is not StepStatus.OK:
            raise RuntimeError(f"a kernel warm-up step failed: {output.status.name} "
                               f"{output.error or ''}".rstrip())


def warm_up_graph_paths(runner: WarmupRunner, warmup: KernelWarmup, max_model_len: int,
                        max_num_seqs: int, captured: set[Variant]) -> KernelWarmup:
    """After the CUDA graph capture: the warm-up steps again, each with a prefill chunk so that
    it runs as pieces (where it fits one), whose attention ops read q/k/v from the pieces'
    static buffers: other strides than an eager pass's views, which Triton may specialize on.
    ``warmup`` plus what they and the capture (``captured``) launched."""
    _, steps = _plan(runner, max_model_len, max_num_seqs, prefill_in_every_step=True)
    started = time.perf_counter()
    with recording() as seen:
        run_steps(runner, steps)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    added = (frozenset(seen) | captured) - warmup.variants
    if added:
        logger.info("Triton kernels: %d more variants for the CUDA graph paths in %.2f s (%s)",
                    len(added), time.perf_counter() - started, describe(added))
    return dataclasses.replace(warmup, variants=warmup.variants | added,
                               seconds=warmup.seconds + time.perf_counter() - started)


def missing_decode_paths(variants: frozenset[Variant] | set[Variant],
                         shapes: dict[bool, tuple[int, int]]) -> list[str]:
    """The decode paths (and the merge a split needs) in ``shapes`` that no variant covers."""
    from kernels.triton_attention import is_decode_launch

    decode_splits = {v.constant("SPLIT") for v in variants
                     if v.kernel == DECODE_KERNEL and is_decode_launch(dict(v.constants))}
    missing = [f"the {'split' if split else 'unsplit'} decode" for split in sorted(shapes)
               if split not in decode_splits]
    if True in shapes and not any(v.kernel == MERGE_KERNEL for v in variants):
        missing.append("the split merge")
    return missing


def describe(variants: frozenset[Variant] | set[Variant]) -> str:
    counts: dict[str, int] = {}
    for variant in variants:
        counts[variant.kernel] = counts.get(variant.kernel, 0) + 1
    return ", ".join(f"{name.strip('_')} x{count}" for name, count in sorted(counts.items()))


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    from kernels import triton_attention

    return isinstance(triton_attention._paged_attention_kernel, InterpretedFunction)
