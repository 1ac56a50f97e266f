"""Persistent device tensors for a step's inputs, filled in place by ``prepare_inputs``.

A CUDA graph replays its kernels on the addresses they were captured with, so every input a
captured step reads must live at a fixed address: the token ids, positions, KV slots, block
tables, context lengths and the rows to sample. The runner keeps one buffer of each, sized for
the largest step the engine schedules, and each step fills their prefixes (one host-to-device
copy per buffer, from pinned memory and non-blocking on CUDA, so the copies queue behind the
previous step's work instead of waiting for it). Eager steps gain too: no allocation per step.

A step larger than the buffers (the engine passes its limits, so only a caller that did not,
such as a test, meets one) grows them; ``generation`` counts the growths, so that whatever
captured the old addresses can tell it must not replay them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepLimits:
    """The largest step the scheduler can hand the runner."""

    max_num_tokens: int = 0
    max_num_seqs: int = 0
    max_model_len: int = 0


class StepBuffers:
    # One-dimensional buffers with a slot per token of the step, and with one per sequence.
    TOKEN_BUFFERS = ("input_ids", "positions", "slot_mapping")
    SEQ_BUFFERS = ("context_lens", "logits_indices")

    def __init__(self, device: torch.device, limits: StepLimits, block_size: int,
                 num_kv_groups: int = 1) -> None:
        self.device = device
        self.block_size = block_size
        # KV cache groups past the first (engine.core.kv_groups): a slot mapping and block
        # tables of their own each.
        self.num_other_groups = num_kv_groups - 1
        # Pinned host memory lets the copies run asynchronously; the CPU has nothing to pin.
        self.pin = device.type == "cuda"
        self.generation = 0
        self.max_tokens = max(1, limits.max_num_tokens)
        # The kernel warm-up's steps hold max_num_seqs decodes and a prefill chunk.
        self.max_seqs = max(1, limits.max_num_seqs + 1)
        self.max_blocks = max(1, -(-limits.max_model_len // block_size))
        self._allocate()

    def _allocate(self) -> None:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=self.device)

        self.input_ids = zeros(self.max_tokens)
        self.positions = zeros(self.max_tokens)
        self.slot_mapping = zeros(self.max_tokens)
        # Every sequence's block table, decodes' first: [max_seqs, max_model_len's blocks].
        self.block_tables = zeros(self.max_seqs, self.max_blocks)
        self.context_lens = zeros(self.max_seqs)
        self.logits_indices = zeros(self.max_seqs)
        self.group_slot_mappings = [zeros(self.max_tokens) for _ in range(self.num_other_groups)]
        self.group_block_tables = [zeros(self.max_seqs, self.max_blocks)
                                   for _ in range(self.num_other_groups)]

    def reserve(self, num_tokens: int, num_seqs: int, max_blocks: int) -> None:
        """Grow the buffers (doubling) until a step of this size fits."""
        if (num_tokens <= self.max_tokens and num_seqs <= self.max_seqs
                and max_blocks <= self.max_blocks):
            return
        while self.max_tokens < num_tokens:
            self.max_tokens *= 2
        while self.max_seqs < num_seqs:
            self.max_seqs *= 2
        while self.max_blocks < max_blocks:
            self.max_blocks *= 2
        logger.debug("step buffers grown to %d tokens, %d sequences x %d blocks",
                     self.max_tokens, self.max_seqs, self.max_blocks)
        self._allocate()
        self.generation += 1

    def upload(self, buffer: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """Copy ``host`` (int64, on the CPU) into the leading corner of ``buffer``; returns that
        view of the buffer."""
        if host.dtype != torch.long:
            raise TypeError(f"step inputs are int64, got {host.dtype}")
        view = buffer[tuple(slice(0, n) for n in host.shape)]
        if host.numel() == 0:
            return view
        if self.pin:
            host = host.pin_memory()
        view.copy_(host, non_blocking=self.pin)
        return view
