"""Paged KV cache bookkeeping: block tables, reference counts and the prefix cache.

The block tensors live in the model runner; this module decides which block holds which
tokens (PagedAttention, Kwon et al., SOSP 2023, section 4.2).

Prefix caching (vLLM's automatic prefix caching; SGLang's RadixAttention, Zheng et al.,
2024, keeps the same reuse in a radix tree): a block full of computed tokens is named by
a hash of its token ids chained with the hash of the block before it, so equal prefixes
give equal names. A block is shared by reference count; when its last user lets go it
stays cached, still findable by name, among the free blocks, and is evicted (its name
dropped) only when its space is handed out again, least recently freed first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


class BlockManager:
    """Allocates KV blocks of ``block_size`` tokens to sequences, sharing cached prefixes.

    Free blocks include cached blocks no sequence holds: they count as free capacity
    (admission and preemption see them as room) and are evicted on reuse.

    Invariants (checked by :meth:`check`): every block is free or held; a block's
    reference count equals the number of block tables that hold it; every name in the
    cache maps to a block that carries it.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        cache_salt: str = "",
    ) -> None:
        """``cache_salt`` goes into the first block's hash: KV computed under another
        salt (another model or dtype) never matches."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._root = hashlib.sha256(cache_salt.encode()).digest()
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        """Free blocks, evicted from the front: blocks with no name first, then cached
        blocks least recently freed first."""
        self._refs = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._names: dict[str, list[bytes]] = {}
        """Sequence id -> the hashes of its leading full blocks, as far as computed (a
        waiting sequence is looked up every step; its tokens only grow)."""
        self._offered: dict[str, int] = {}
        """Sequence id -> how many of its leading blocks were offered to the cache."""
        self.num_queried_tokens = 0
        """Tokens looked up in the prefix cache at admission, since start."""
        self.num_hit_tokens = 0
        """Of those, tokens found cached (their prefill skipped)."""

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a named prefix, held or free."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held, in [0, 1] (cached free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def hit_rate(self) -> float:
        """Cached tokens over tokens looked up since start, in [0, 1] (0 before any)."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def cached_prefix(
        self, token_ids: Sequence[int], seq_id: str | None = None, salt: bytes = b""
    ) -> list[int]:
        """The blocks of the longest cached prefix of ``token_ids`` made of full blocks,
        leaving at least the last token uncached (its logits must be computed to sample).
        ``seq_id`` keeps the block hashes for the sequence's later lookups. ``salt``
        separates KV computed under different weights for the same tokens (a LoRA
        adapter's key; empty: the base model): pass the same to :meth:`commit`.

        Changes no block: pass the result to :meth:`allocate` to take the blocks.
        """
        if not self.enable_prefix_caching:
            return []
        names = self._names.setdefault(seq_id, []) if seq_id is not None else []
        blocks: list[int] = []
        for i in range((len(token_ids) - 1) // self.block_size):
            block = self._cached.get(self._name_at(names, token_ids, i, salt))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_new_blocks(self, seq_id: str, total_tokens: int, prefix: Sequence[int] = ()) -> int:
        """Free blocks that ``seq_id`` must take to hold ``total_tokens`` tokens, after
        taking ``prefix`` (from :meth:`cached_prefix`; only for a sequence with no table)."""
        held = len(self._tables.get(seq_id) or prefix)
        revived = sum(1 for b in prefix if self._refs[b] == 0)
        return max(0, self.blocks_needed(total_tokens) - held) + revived

    def can_allocate(self, seq_id: str, total_tokens: int, prefix: Sequence[int] = ()) -> bool:
        return self.num_new_blocks(seq_id, total_tokens, prefix) <= len(self._free)

    def allocate(self, seq_id: str, total_tokens: int, prefix: Sequence[int] = ()) -> list[int]:
        """Grow ``seq_id``'s block table to hold ``total_tokens`` tokens; return its table.

        ``prefix``: cached blocks (:meth:`cached_prefix`) that start the table of a
        sequence that holds none; the caller counts their tokens as computed (and tells
        :meth:`record_lookup`).

        Raises:
            RuntimeError: not enough free blocks (call :meth:`can_allocate` first), or a
                prefix for a sequence that already holds blocks.
        """
        need = self.num_new_blocks(seq_id, total_tokens, prefix)
        if need > len(self._free):
            raise RuntimeError(f"{seq_id}: needs {need} KV blocks, {len(self._free)} free")
        if prefix and seq_id in self._tables:
            raise RuntimeError(f"{seq_id}: a cached prefix for a sequence that holds blocks")
        table = self._tables.setdefault(seq_id, [])
        for block in prefix:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
            table.append(block)
        if prefix:
            self._offered[seq_id] = len(prefix)
        while len(table) < self.blocks_needed(total_tokens):
            table.append(self._take_free())
        return table

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's lookup for :attr:`hit_rate` (tokens of the sequence)."""
        if self.enable_prefix_caching:
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens

    def commit(
        self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int, salt: bytes = b""
    ) -> None:
        """Name the blocks of ``seq_id`` that ``num_computed_tokens`` have filled, so that
        later sequences can find them (``salt``: as for :meth:`cached_prefix`). A block
        whose name is already cached (the same prefix computed by another sequence at the
        same time) stays unnamed."""
        if not self.enable_prefix_caching or seq_id not in self._tables:
            return
        table = self._tables[seq_id]
        done = self._offered.get(seq_id, 0)
        full = min(num_computed_tokens // self.block_size, len(table))
        if full <= done:
            return
        names = self._names.setdefault(seq_id, [])
        for i in range(done, full):
            name = self._name_at(names, token_ids, i, salt)
            if name not in self._cached:
                self._cached[name] = table[i]
                self._hash[table[i]] = name
        self._offered[seq_id] = full

    def free(self, seq_id: str) -> None:
        """Drop ``seq_id``'s hold on its blocks (no-op if it holds none). Unnamed blocks
        go to the front of the free list; named ones stay cached at its back, the
        sequence's last block first, so a shared prefix outlives its tails."""
        self._names.pop(seq_id, None)
        self._offered.pop(seq_id, None)
        for block in reversed(self._tables.pop(seq_id, ())):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
                if self._hash[block] is None:
                    self._free.move_to_end(block, last=False)

    def check(self) -> None:
        """Assert the invariants in the class docstring (for tests; O(blocks))."""
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            for block in table:
                refs[block] += 1
        assert refs == self._refs, "reference counts differ from the block tables"
        for block in range(self.num_blocks):
            assert (block in self._free) == (refs[block] == 0), f"block {block} free and held"
        for name, block in self._cached.items():
            assert self._hash[block] == name, f"block {block} lost its name"
        assert sum(h is not None for h in self._hash) == len(self._cached)

    def _take_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        name = self._hash[block]
        if name is not None:  # evict: its KV is about to be overwritten
            del self._cached[name]
            self._hash[block] = None
        self._refs[block] = 1
        return block

    def _name_at(
        self, names: list[bytes], token_ids: Sequence[int], i: int, salt: bytes = b""
    ) -> bytes:
        """The hash of block ``i`` of ``token_ids``, chained on the hash of the block
        before it (the cache's salt and ``salt``'s for the first); ``names`` memoises the
        chain."""
        bs = self.block_size
        while len(names) <= i:
            k = len(names)
            tokens = array("q", token_ids[k * bs : (k + 1) * bs]).tobytes()
            if names:
                head = names[-1]
            else:
                head = hashlib.sha256(self._root + salt).digest() if salt else self._root
            names.append(hashlib.sha256(head + tokens).digest())
        return names[i]
