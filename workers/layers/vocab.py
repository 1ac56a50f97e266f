"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded to a multiple of tp_size and split into equal contiguous ranges; rank r
owns token ids [r * per_rank, (r + 1) * per_rank). Padding rows stay zero and padded logits are
cut off after the gather. Embedding and head share this layout so a tied head can reuse the
embedding's weight on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kernels.cpu_bf16_linear import Bf16Weight
from workers.layers.cpu_prepack import linear
from workers.layers.linear import weakly_bound


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, dtype: torch.dtype,
                 device: torch.device | str, tp_rank: int = 0, tp_size: int = 1,
                 tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.num_embeddings_per_partition = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(
            torch.zeros(self.num_embeddings_per_partition, embedding_dim, dtype=dtype,
                        device=device), requires_grad=False)
        # Weakly: no module <-> parameter cycle (workers.layers.linear.weakly_bound).
        self.weight.weight_loader = weakly_bound(self.weight_loader)  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor,
                      shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"unexpected shard_id {shard_id!r} for {type(self).__name__}")
        if loaded_weight.shape != (self.num_embeddings, param.shape[1]):
            raise ValueError(f"weight shape mismatch: expected "
                             f"{(self.num_embeddings, param.shape[1])}, checkpoint has "
                             f"{tuple(loaded_weight.shape)}")
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded_weight[self.vocab_start:self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids outside this rank's range look up row 0 and are zeroed; the all-reduce then sums
        # exactly one non-zero contribution per token.
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.tp_group)
        return out

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings}, per_rank={self.num_embeddings_per_partition}, "
                f"dim={self.weight.shape[1]}, tp={self.tp_rank}/{self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h W^T over this rank's vocabulary slice, gathered to the full vocabulary on every
    rank when tp_size > 1 (all ranks then hold identical logits)."""

    prepack_weight = True  # see workers.layers.cpu_prepack (as workers.layers.linear.LinearBase)
    linear_kernel: str | None = None
    packed_weight: torch.Tensor | None = None
    packed_min_rows = 0
    bf16_weight: Bf16Weight | None = None  # see workers.layers.cpu_bf16_weights
    bf16_max_rows = 0

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden_states, self.weight, None, self.packed_weight,
                        self.packed_min_rows, self.bf16_weight, self.bf16_max_rows)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
            logits = torch.cat(parts, dim=-1)
        if logits.shape[-1] != self.num_embeddings:
            logits = logits[..., :self.num_embeddings]
        return logits
