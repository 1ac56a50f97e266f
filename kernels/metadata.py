"""The batch description every attention implementation reads: where a step's tokens go in the
paged KV cache and which context each query attends over (layout in ``kernels.attention``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class DeviceLayout:
    """A step's sequences described on the device alone, for a launch whose grid and arguments
    do not change with the batch (a CUDA graph captured once per padded token count replays it
    for any mix of decodes and chunks). Every sequence, decodes included, is a chunk: its
    ``query_len`` tokens start at row ``query_start`` and end its ``context_len`` tokens of
    context. A program owns a tile of ``block_q`` query tokens of one sequence (``tile_seq``,
    ``tile_offset``); the tiles past the step's own point at a sequence of no tokens, and so do
    nothing. The host rewrites the tensors in place before each replay
    (workers.graphs.attention_layout)."""

    block_q: int
    tile_seq: torch.Tensor
    tile_offset: torch.Tensor
    query_start: torch.Tensor
    query_len: torch.Tensor
    context_len: torch.Tensor
    # [sequences, blocks] block tables, the layer's KV cache group's.
    block_tables: torch.Tensor


@dataclass
class AttentionMetadata:
    # [num_tokens] int64: where each new token's K/V is written.
    slot_mapping: torch.Tensor
    num_decodes: int
    # [num_decodes, max_blocks] int64 block tables (padded with 0) and [num_decodes] context
    # lengths (including the token being decoded).
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    # Per prefill chunk: query length, total context length (cached prefix + chunk), block table.
    prefill_query_lens: list[int]
    prefill_context_lens: list[int]
    prefill_block_tables: list[torch.Tensor]
    # The longest and shortest decode context, as host ints: the kernels size their work by
    # them, and reading them back from decode_context_lens inside the forward pass would stall
    # the host on the device at every step (and cannot be captured in a CUDA graph). The model
    # runner computes them from the scheduler's host-side lengths; left at -1, they are read
    # from decode_context_lens here, before any forward pass (tests and benchmarks).
    decode_max_context: int = -1
    decode_min_context: int = -1
    # Every decode's context length as host ints, when the model runner has them (None: a
    # captured graph's static metadata, whose lengths change at each replay). The CPU kernel
    # groups decodes of similar contexts with them, instead of padding every row to the
    # longest (kernels.torch_attention).
    decode_context_list: list[int] | None = None
    # A model whose layers keep KV in several groups (engine.core.kv_groups: sliding-window
    # layers beside full ones): group g's metadata for g >= 1, its own slot mapping and block
    # tables over the same lengths. Empty: every layer reads this one (one group, or metadata
    # built for a kernel warm-up).
    other_groups: list[AttentionMetadata] = field(default_factory=list, repr=False,
                                                  compare=False)
    # A captured step's layout on the device (see DeviceLayout): when set, the kernels read it
    # instead of the host-side fields above (``num_decodes`` 0, no prefill lists), and the
    # rows past its tokens are padding that nothing reads or writes (their slots are -1).
    # Only the Triton kernels read it.
    device_layout: DeviceLayout | None = field(default=None, repr=False, compare=False)
    # Per-step values the kernels derive from the fields above (gather indices, masks). Every layer
    # of a step sees the same metadata, so they are built once on the first layer and reused by the
    # other layers. Owned by the implementation; never set it.
    derived: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_decodes > 0 and (self.decode_max_context < 0 or self.decode_min_context < 0):
            lens = self.decode_context_lens.tolist()
            self.decode_max_context, self.decode_min_context = max(lens), min(lens)

    def clear_derived(self) -> None:
        """Forget what the kernels derived, in every group (a captured graph's metadata, whose
        tables change at each replay)."""
        self.derived.clear()
        for meta in self.other_groups:
            meta.derived.clear()

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of the layers of KV cache group ``group``."""
        return self.other_groups[group - 1] if group and self.other_groups else self

    def without_last_prefills(self, count: int) -> AttentionMetadata:
        """The metadata of this batch minus its last ``count`` prefill chunks: the layers below
        a resumed chunk's layer run without it (see ``workers.models.LayerJoin``)."""
        if count == 0:
            return self
        if not 0 < count <= len(self.prefill_query_lens):
            raise ValueError(f"cannot drop {count} of {len(self.prefill_query_lens)} prefills")
        kept = len(self.prefill_query_lens) - count
        num_tokens = self.num_decodes + sum(self.prefill_query_lens[:kept])
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens], num_decodes=self.num_decodes,
            decode_block_tables=self.decode_block_tables,
            decode_context_lens=self.decode_context_lens,
            prefill_query_lens=self.prefill_query_lens[:kept],
            prefill_context_lens=self.prefill_context_lens[:kept],
            prefill_block_tables=self.prefill_block_tables[:kept],
            decode_max_context=self.decode_max_context,
            decode_min_context=self.decode_min_context,
            decode_context_list=self.decode_context_list,
            other_groups=[m.without_last_prefills(count) for m in self.other_groups])


def padded_block_tables(tables: Sequence[torch.Tensor | Sequence[int]],
                        extra_columns: int = 0) -> torch.Tensor:
    """[len(tables), longest + extra_columns] int64 block tables, padded with block 0 (which the
    kernels never read: a context length bounds every lookup)."""
    rows = [torch.as_tensor(t, dtype=torch.long) for t in tables]
    width = max((r.numel() for r in rows), default=0) + extra_columns
    padded = torch.zeros((len(rows), width), dtype=torch.long,
                         device=rows[0].device if rows else None)
    for i, row in enumerate(rows):
        padded[i, :row.numel()] = row
    return padded
