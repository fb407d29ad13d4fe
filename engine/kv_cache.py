"""Paged KV cache bookkeeping: a free list of fixed-size blocks and a block table per sequence.

The block tensors themselves live in the model runner; this module only decides which
block holds which tokens (PagedAttention, Kwon et al., SOSP 2023, section 4.2).
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Allocates KV blocks of ``block_size`` tokens to sequences.

    Invariant (checked by :meth:`check`): blocks held plus blocks free equal ``num_blocks``.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def num_new_blocks(self, seq_id: str, total_tokens: int) -> int:
        """Blocks that ``seq_id`` must gain to hold ``total_tokens`` tokens."""
        return max(0, self.blocks_needed(total_tokens) - len(self.block_table(seq_id)))

    def can_allocate(self, seq_id: str, total_tokens: int) -> bool:
        return self.num_new_blocks(seq_id, total_tokens) <= len(self._free)

    def allocate(self, seq_id: str, total_tokens: int) -> list[int]:
        """Grow ``seq_id``'s block table to hold ``total_tokens`` tokens; return its table.

        Raises:
            RuntimeError: not enough free blocks (call :meth:`can_allocate` first).
        """
        need = self.num_new_blocks(seq_id, total_tokens)
        if need > len(self._free):
            raise RuntimeError(f"{seq_id}: needs {need} KV blocks, {len(self._free)} free")
        table = self._tables.setdefault(seq_id, [])
        for _ in range(need):
            table.append(self._free.popleft())
        return table

    def free(self, seq_id: str) -> None:
        """Return all of ``seq_id``'s blocks to the free list (no-op if it holds none)."""
        for block in self._tables.pop(seq_id, ()):
            self._free.append(block)

    def check(self) -> None:
        held = sum(len(t) for t in self._tables.values())
        assert held + len(self._free) == self.num_blocks, (held, len(self._free))
