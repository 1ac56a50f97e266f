"""The attention layout a captured mixed step reads on the device (``kernels.DeviceLayout``).

A piece of a step with prefill tokens holds its layer's attention (workers.graphs.piecewise_graphs)
only if the attention launch is the same at every replay of the piece's token count: the same
grid and the same argument addresses, whatever mix of decodes and chunks the step holds. So the
launch takes every sequence as a chunk (a decode is a chunk of one token) and its tiles from a
table on the device, with a tile count fixed for the size:

    tiles(size) = ceil(size / block_q) + min(size, max_seqs)

which no step of ``size`` tokens exceeds (each sequence's last tile may be partial). The tiles a
step leaves over point at an empty sequence (``EMPTY``: no tokens, no context), whose programs
read and write nothing. Before each replay the host writes the step's tiles and per-sequence
lengths into one packed buffer with one upload; the block tables are the step buffers' own.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kernels.metadata import AttentionMetadata, DeviceLayout
from workers.step_buffers import StepBuffers


def _even(n: int) -> int:
    # Each section of the packed buffer starts 16-byte aligned: Triton compiles a kernel variant
    # per pointer alignment, and the eager launches' own tensors are aligned.
    return n + n % 2


class AttentionLayouts:
    """One packed int64 buffer holding the tiles and lengths of the step being replayed, and the
    metadata each captured size reads it through."""

    def __init__(self, buffers: StepBuffers, block_q: int, max_tokens: int) -> None:
        self.buffers = buffers
        self.block_q = block_q
        # Sequence rows 0..max_seqs-1 are the step's; row ``empty`` has no tokens and no context.
        self.max_seqs = buffers.max_seqs
        self.empty = self.max_seqs
        self.max_tiles = self.tiles(max_tokens)
        tiles, seqs = _even(self.max_tiles), _even(self.max_seqs + 1)
        self._sections = {"tile_seq": (0, tiles), "tile_offset": (tiles, tiles),
                          "query_start": (2 * tiles, seqs), "query_len": (2 * tiles + seqs, seqs),
                          "context_len": (2 * tiles + 2 * seqs, seqs)}
        self.packed = torch.zeros(2 * tiles + 3 * seqs, dtype=torch.long, device=buffers.device)
        # What the host writes each step; the empty row's lengths stay 0.
        self._host = np.zeros(self.packed.numel(), dtype=np.int64)
        self.clear()

    def tiles(self, size: int) -> int:
        """The fixed tile count of a step of ``size`` tokens."""
        return -(-size // self.block_q) + min(size, self.max_seqs)

    def _view(self, array: torch.Tensor | np.ndarray, name: str) -> torch.Tensor | np.ndarray:
        start, length = self._sections[name]
        return array[start:start + length]

    def metadata(self, size: int, num_kv_groups: int) -> AttentionMetadata:
        """The metadata the pieces of ``size`` read, every KV cache group's (the same tiles and
        lengths over the group's own slots and block tables)."""
        buffers = self.buffers
        tiles = self.tiles(size)
        lengths = {name: self._view(self.packed, name) for name in self._sections}
        empty = torch.zeros((0,), dtype=torch.long, device=buffers.device)

        def group_metadata(slots: torch.Tensor, tables: torch.Tensor) -> AttentionMetadata:
            layout = DeviceLayout(
                block_q=self.block_q, tile_seq=lengths["tile_seq"][:tiles],
                tile_offset=lengths["tile_offset"][:tiles],
                query_start=lengths["query_start"], query_len=lengths["query_len"],
                context_len=lengths["context_len"], block_tables=tables)
            return AttentionMetadata(
                slot_mapping=slots[:size], num_decodes=0,
                decode_block_tables=empty.view(0, 0), decode_context_lens=empty,
                prefill_query_lens=[], prefill_context_lens=[], prefill_block_tables=[],
                device_layout=layout)

        meta = group_metadata(buffers.slot_mapping, buffers.block_tables)
        meta.other_groups = [group_metadata(slots, tables) for slots, tables
                             in list(zip(buffers.group_slot_mappings,
                                         buffers.group_block_tables))[:num_kv_groups - 1]]
        return meta

    def clear(self) -> None:
        """No sequence: every tile empty (what the capture runs over, so that it reads and
        writes no cache)."""
        self.write(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))

    def write(self, query_lens: np.ndarray | Sequence[int],
              context_lens: np.ndarray | Sequence[int]) -> None:
        """The step's sequences, in batch order (decodes first): each one's query tokens and
        its context including them. One upload."""
        query_lens = np.asarray(query_lens, dtype=np.int64)
        context_lens = np.asarray(context_lens, dtype=np.int64)
        num_seqs = query_lens.size
        if num_seqs > self.max_seqs:
            raise ValueError(f"{num_seqs} sequences exceed the layout's {self.max_seqs}")
        tiles_per_seq = -(-query_lens // self.block_q)
        num_tiles = int(tiles_per_seq.sum())
        if num_tiles > self.max_tiles:
            raise ValueError(f"{num_tiles} tiles exceed the layout's {self.max_tiles}")
        host = self._host
        tile_seq, tile_offset = self._view(host, "tile_seq"), self._view(host, "tile_offset")
        seq_of_tile = np.repeat(np.arange(num_seqs), tiles_per_seq)
        first_tile = np.cumsum(tiles_per_seq) - tiles_per_seq
        tile_seq[:num_tiles] = seq_of_tile
        tile_seq[num_tiles:] = self.empty
        tile_offset[:num_tiles] = (np.arange(num_tiles) - first_tile[seq_of_tile]) * self.block_q
        tile_offset[num_tiles:] = 0
        self._view(host, "query_start")[:num_seqs] = np.cumsum(query_lens) - query_lens
        self._view(host, "query_len")[:num_seqs] = query_lens
        self._view(host, "context_len")[:num_seqs] = context_lens
        self.buffers.upload(self.packed, torch.from_numpy(host))
