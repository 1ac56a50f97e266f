"""Sizing the KV pool from a GPU's memory, as vLLM's ``--gpu-memory-utilization`` does: once the
weights are loaded, run the largest steps the scheduler can make to measure their activations
(every sequence within ``max_model_len``), and give the pool what is left of ``utilization`` x
the GPU's memory.

Used memory is what the device reports (weights, CUDA contexts, and any other process on the
GPU), so ``utilization`` bounds everything on the device, as in vLLM before its V1 engine. The
pool never exceeds what ``max_num_seqs`` sequences of ``max_model_len`` tokens can fill.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput, StepStatus
from engine.core.token_budget import largest_step_tokens, split_token_budget
from engine.worker_messages import KVPoolPlan
from engine.sampling_params import SamplingParams
from workers.kv_cache import kv_caches_bytes_per_block

if TYPE_CHECKING:
    from workers.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_GIB = 2**30


@dataclass(frozen=True)
class GPUMemory:
    total_bytes: int
    # In use on the device once the weights are loaded and the profiled steps are done.
    used_bytes: int
    # The profiled steps' peak allocation above what was allocated before them.
    activation_peak_bytes: int


def kv_pool_blocks(memory: GPUMemory, utilization: float, bytes_per_block: int,
                   max_blocks: int) -> int:
    """KV blocks that fit in ``utilization`` of the GPU beside what is in use and one step's
    activations, at most ``max_blocks``; 0 when nothing fits."""
    budget = utilization * memory.total_bytes - memory.used_bytes - memory.activation_peak_bytes
    return min(max_blocks, max(0, int(budget // bytes_per_block)))


def describe(memory: GPUMemory, plan: KVPoolPlan, num_blocks: int, bytes_per_block: int) -> str:
    capped = (f" (capped: {plan.max_num_seqs} sequences of max_model_len fill no more)"
              if num_blocks == plan.max_blocks else "")
    return (f"{plan.gpu_memory_utilization:g} x {memory.total_bytes / _GIB:.2f} GiB - "
            f"{memory.used_bytes / _GIB:.2f} GiB in use after loading the weights - "
            f"{memory.activation_peak_bytes / _GIB:.2f} GiB for a step's activations -> "
            f"{num_blocks} blocks of {bytes_per_block} bytes "
            f"({num_blocks * bytes_per_block / _GIB:.2f} GiB){capped}")


def profile_steps(max_num_batched_tokens: int, max_num_seqs: int, block_size: int,
                  max_model_len: int) -> list[SchedulerOutput]:
    """The steps whose activations peak highest: the whole token budget in as few sequences as
    max_model_len allows (the longest attention), and spread over as many sequences as may run,
    each sampled (the most logits rows). No sequence is longer than max_model_len: a longer one
    reads past the rotary table, a device-side assert at startup on a GPU. The budget is the
    largest step the scheduler can make (at most max_num_seqs sequences of max_model_len).
    Their blocks are numbered from 0 in a scratch pool."""
    tokens = largest_step_tokens(max_num_batched_tokens, max_num_seqs, max_model_len)
    return [_profile_step(split_token_budget(tokens, max_model_len), block_size),
            _profile_step(split_token_budget(tokens, max_model_len, min_seqs=max_num_seqs),
                          block_size)]


def _profile_step(lengths: list[int], block_size: int) -> SchedulerOutput:
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    requests: list[ScheduledRequest] = []
    next_block = 0
    for i, length in enumerate(lengths):
        blocks = -(-length // block_size)
        requests.append(ScheduledRequest(
            req_id=f"profile-{i}", token_ids=[0] * length, start_pos=0,
            block_ids=list(range(next_block, next_block + blocks)), sample=True,
            sampling_params=greedy))
        next_block += blocks
    return SchedulerOutput(step_id=0, requests=requests)


def scratch_blocks(steps: list[SchedulerOutput]) -> int:
    return max(max(b for r in step.requests for b in r.block_ids) + 1 for step in steps)


def measure_kv_pool(runner: ModelRunner, plan: KVPoolPlan) -> int:
    """On the runner's GPU, after its weights are loaded: how many KV blocks this rank can hold.
    Runs the profile steps on a scratch pool; leaves the runner with an empty pool."""
    device: torch.device = runner.device
    bytes_per_block = kv_caches_bytes_per_block(runner.kv_caches)
    steps = profile_steps(plan.max_num_batched_tokens, plan.max_num_seqs, runner.block_size,
                          plan.max_model_len)
    runner.resize_kv_pool(scratch_blocks(steps))
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        for step in steps:
            if runner.execute(step).status is not StepStatus.OK:
                raise RuntimeError("the profiling step did not complete")
    except torch.cuda.OutOfMemoryError as exc:
        raise ValueError(f"a step of max_num_batched_tokens {plan.max_num_batched_tokens} "
                         f"tokens does not fit on the GPU beside the weights: lower it") from exc
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - before
    runner.resize_kv_pool(0)
    torch.cuda.empty_cache()  # memory this process cached but does not use is free for the pool
    free, total = torch.cuda.mem_get_info(device)
    memory = GPUMemory(total_bytes=total, used_bytes=total - free,
                       activation_peak_bytes=activation_peak)
    num_blocks = kv_pool_blocks(memory, plan.gpu_memory_utilization, bytes_per_block,
                                plan.max_blocks)
    logger.info("KV pool on %s (gpu_memory_utilization): %s", device,
                describe(memory, plan, num_blocks, bytes_per_block))
    return num_blocks
