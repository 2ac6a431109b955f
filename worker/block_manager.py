"""KV block accounting: which fixed-size blocks each sequence owns.

Pure Python, no tensors. A block id names the same slot range in every
layer's pool (the model runner holds one K and one V pool per layer), so one
allocation here covers all layers. Invariant: every block id is either in the
free list or in exactly one block table, never both, never neither.

Each sequence holding a table also holds a *row*: its index in the model
runner's persistent device copy of all tables. Every entry written since the
runner last looked is logged, so the runner uploads only what changed.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


class Allocation:
    """Result of a successful ``allocate``: the blocks added and the full table as it was then (copied
    only if asked: tables are only ever appended to, so a length marks the snapshot)."""

    __slots__ = ("new_block_ids", "_table", "_len")

    def __init__(self, new_block_ids: tuple[int, ...], table: list[int] | tuple[int, ...]) -> None:
        self.new_block_ids = new_block_ids
        self._table = table
        self._len = len(table)

    @property
    def block_table(self) -> tuple[int, ...]:
        return tuple(self._table[:self._len])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Allocation):
            return NotImplemented
        return (self.new_block_ids, self.block_table) == (other.new_block_ids, other.block_table)

    def __repr__(self) -> str:
        return f"Allocation(new_block_ids={self.new_block_ids}, block_table={self.block_table})"


@dataclass(frozen=True)
class BlockUsage:
    num_blocks: int
    num_free: int
    num_used: int
    utilisation: float  # used / total, in [0, 1]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: freed blocks are reused first, which keeps the working set warm.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        self._rows: dict[str, int] = {}
        self._free_rows: list[int] = []  # a heap: the lowest free row is reused first
        self.num_rows = 0  # rows ever handed out: the height the device copy needs
        # (row, column) -> block id written since the last take_table_updates(); a dict so that an
        # entry written twice (a row freed and reused within one step) is sent once, with its last value.
        self._updates: dict[tuple[int, int], int] = {}

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def num_missing(self, seq_id: str, num_tokens: int) -> int:
        """Blocks ``seq_id`` still needs so that its table covers ``num_tokens``."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        return self.num_missing(seq_id, num_tokens) <= len(self._free)

    def allocate(self, seq_id: str, num_tokens: int) -> Allocation | None:
        """Grow ``seq_id``'s table to cover ``num_tokens``; None (nothing taken) if there is no room."""
        missing = self.num_missing(seq_id, num_tokens)
        if missing > len(self._free):
            return None
        table = self._tables.get(seq_id)
        if table is None:
            table = self._tables[seq_id] = []
            self._rows[seq_id] = self._take_row()
        new = [self._free.pop() for _ in range(missing)]
        row, col = self._rows[seq_id], len(table)
        for i, b in enumerate(new):
            self._updates[(row, col + i)] = b
        table.extend(new)
        return Allocation(tuple(new), table)

    def _take_row(self) -> int:
        if self._free_rows:
            return heapq.heappop(self._free_rows)
        self.num_rows += 1
        return self.num_rows - 1

    def row(self, seq_id: str) -> int:
        """``seq_id``'s row in the runner's device block table (KeyError if it holds no table)."""
        return self._rows[seq_id]

    def take_table_updates(self) -> dict[tuple[int, int], int]:
        """Entries (row, column) -> block id written since the last call; clears the log."""
        updates, self._updates = self._updates, {}
        return updates

    def block_table(self, seq_id: str) -> list[int]:
        """The live table (callers must not mutate it); empty if the sequence has none."""
        return self._tables.get(seq_id, [])

    def has_blocks(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def free(self, seq_id: str) -> int:
        """Return all of ``seq_id``'s blocks to the pool; the number freed (0 if it had none)."""
        table = self._tables.pop(seq_id, None)
        row = self._rows.pop(seq_id, None)
        if row is not None:
            heapq.heappush(self._free_rows, row)
        if not table:
            return 0
        self._free.extend(reversed(table))
        return len(table)

    def usage(self) -> BlockUsage:
        used = self.num_blocks - len(self._free)
        return BlockUsage(self.num_blocks, len(self._free), used, used / self.num_blocks)

    def check_invariants(self) -> None:
        """Assert the free list and the tables partition the block ids (tests and the simulator)."""
        owned = [b for t in self._tables.values() for b in t]
        everything = owned + self._free
        assert len(everything) == self.num_blocks, (len(everything), self.num_blocks)
        assert set(everything) == set(range(self.num_blocks)), "block ids lost or duplicated"
        rows = list(self._rows.values())
        assert self._rows.keys() == self._tables.keys(), "a table without a row or a row without a table"
        assert len(set(rows)) == len(rows) and not set(rows) & set(self._free_rows), "a row held twice"
        assert sorted(rows + self._free_rows) == list(range(self.num_rows)), "rows lost"
