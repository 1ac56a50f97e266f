"""Each running request's KV block table, kept by the workers across steps.

A step sends only what changed of a table (``ScheduledRequest.block_table_start`` and the ids
from there on: engine/core/kv_cache_manager.py ``table_update``), since a decode starts a new
block once every ``block_size`` tokens while its table holds one id per block of its context
(~1900 at 30k tokens). The tables live in one host array with a row per request, so a step's
tables are one gather of rows, not a walk over every block id of every request.

The protocol keeps the rows valid without acknowledgements: a request's table only grows at its
end or loses blocks from its end (a rolled-back step's) or all of them, and the scheduler counts
what it sent down to what is left after each loss, so ``block_table_start`` never points past
what the workers hold and everything before it is still the request's. Requests whose blocks
were all freed come in ``SchedulerOutput.released_req_ids`` and give their rows back first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from engine.core.scheduler_output import ScheduledRequest


class BlockTables:
    """The tables of one KV cache group (engine.core.kv_groups): ``group`` picks which of a
    scheduled request's updates it applies."""

    def __init__(self, max_blocks: int, rows: int = 64, group: int = 0) -> None:
        self.group = group
        self.table = np.zeros((max(1, rows), max(1, max_blocks)), np.int64)
        # How many leading entries of each row are the request's blocks.
        self.widths = np.zeros(self.table.shape[0], np.int64)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(self.table.shape[0] - 1, -1, -1))

    def release(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            row = self.row_of.pop(req_id, None)
            if row is not None:
                self._truncate(row, 0)
                self._free_rows.append(row)

    def update(self, request: ScheduledRequest) -> int:
        """Apply ``request``'s update to its table; returns its row."""
        row = self.row_of.get(request.req_id)
        start = request.block_table_start
        if row is None:
            if start:
                raise ValueError(f"request {request.req_id!r}: block table update from index "
                                 f"{start}, but no earlier blocks were sent")
            row = self._new_row()
            self.row_of[request.req_id] = row
        elif start > self.widths[row]:
            raise ValueError(f"request {request.req_id!r}: block table update from index {start}, "
                             f"but only {self.widths[row]} blocks are held")
        # A request built without the other groups' ids (the startup warm-up's made-up ones)
        # uses the first group's in every group.
        ids = (request.group_block_ids[self.group - 1]
               if self.group and request.group_block_ids else request.block_ids)
        end = start + len(ids)
        if ids:
            if end > self.table.shape[1]:
                self._grow(columns=end)
            self.table[row, start:end] = ids
        self._truncate(row, end)
        return row

    def _truncate(self, row: int, width: int) -> None:
        """Set the row's width, zeroing what a longer table left past it (so that a gather
        needs no padding pass: entries past a row's width are always block 0)."""
        old = int(self.widths[row])
        if width < old:
            self.table[row, width:old] = 0
        self.widths[row] = width

    def full_table(self, request: ScheduledRequest) -> list[int]:
        """Apply ``request``'s update; returns its whole table."""
        row = self.update(request)
        return self.table[row, :self.widths[row]].tolist()

    def gather(self, requests: Sequence[ScheduledRequest], width: int | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """Update the tables of ``requests`` and return them as one array, a row each in their
        order, padded with block 0 to the longest (or to ``width``), with each row's width."""
        rows = np.fromiter((self.update(r) for r in requests), np.int64, len(requests))
        widths = self.widths[rows]
        columns = max(int(widths.max()), width or 0)
        if columns > self.table.shape[1]:
            self._grow(columns=columns)
        return self.table[rows, :columns], widths

    def _new_row(self) -> int:
        if not self._free_rows:
            old = self.table.shape[0]
            self._grow(rows=2 * old)
            self._free_rows = list(range(self.table.shape[0] - 1, old - 1, -1))
        return self._free_rows.pop()

    def _grow(self, rows: int = 0, columns: int = 0) -> None:
        if columns > self.table.shape[1]:
            columns = max(columns, 2 * self.table.shape[1])
        shape = (max(rows, self.table.shape[0]), max(columns, self.table.shape[1]))
        table = np.zeros(shape, np.int64)
        table[:self.table.shape[0], :self.table.shape[1]] = self.table
        widths = np.zeros(shape[0], np.int64)
        widths[:self.widths.shape[0]] = self.widths
        self.table, self.widths = table, widths
