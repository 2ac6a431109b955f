"""KV block accounting: which fixed-size blocks each sequence owns.

Pure Python, no tensors. A block id names the same slot range in every
layer's pool (the model runner holds one K and one V pool per layer), so one
allocation here covers all layers. Invariant: every block id is either in the
free list or in exactly one block table, never both, never neither.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Allocation:
    """Result of a successful ``allocate``: the blocks added and the full table."""

    new_block_ids: tuple[int, ...]
    block_table: tuple[int, ...]


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
        table = self._tables.setdefault(seq_id, [])
        new = [self._free.pop() for _ in range(missing)]
        table.extend(new)
        return Allocation(tuple(new), tuple(table))

    def block_table(self, seq_id: str) -> list[int]:
        """The live table (callers must not mutate it); empty if the sequence has none."""
        return self._tables.get(seq_id, [])

    def has_blocks(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def free(self, seq_id: str) -> int:
        """Return all of ``seq_id``'s blocks to the pool; the number freed (0 if it had none)."""
        table = self._tables.pop(seq_id, None)
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
