"""Prefix affinity: which replicas recently served a prompt's leading blocks.

The ingress names a prompt's first :data:`MAX_PREFIX_BLOCKS` blocks (of the replicas'
KV block size) by chained hashes, as the replicas' prefix caches name them; the router
remembers, for each name, the replicas it sent that prefix to, least recently used names
forgotten first. A replica that served a longer prefix of the prompt probably still
holds its KV blocks, so its prefill there would compute only the rest. This is the idea
of Ray Serve LLM's ``PrefixCacheAffinityRouter`` and SGLang's cache-aware router (which
keep a radix tree of text per replica); a bounded map of block hashes does the same
with memory bounded in entries.

The router uses it only as a tie-breaker within the SLOs (:mod:`router.choice`): a cache
hit is never worth a replica whose predicted TTFT would break the SLO while another meets
it, nor one without room for the request's decodes within the TPOT SLO while another has.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence

MAX_PREFIX_BLOCKS = 256
"""Blocks of a prompt the ingress names (4,096 tokens at 16 per block): enough to tell
conversations apart and to estimate their cached tokens, few enough to send along."""
MAX_ENTRIES = 200_000
"""The most prefix names the router remembers (each with its few replicas), about 50 MB."""
ENTRIES_PER_KV_BLOCK = 4
"""Names remembered per KV block the replicas hold (:meth:`PrefixMap.fit`): a name stands
for a block some replica computed, and the replicas' caches evict least recently used
blocks first, as the map does, so names far beyond their capacity name blocks long gone."""
MIN_ENTRIES = 4096
"""The fewest names the map is bounded to, whatever the replicas' KV capacity."""


def prefix_hashes(
    token_ids: Sequence[int], block_size: int, max_blocks: int = MAX_PREFIX_BLOCKS, salt: int = 0
) -> tuple[int, ...]:
    """Chained hashes of the first full blocks of ``token_ids`` (block ``i``'s hash covers
    blocks ``0..i``), at most ``max_blocks``. Python's hash of int tuples is the same in
    every process; a collision only misroutes a request, it never shares KV (the
    replica's cache uses SHA-256 names). ``salt`` starts the chain: a LoRA adapter's
    (:func:`adapter_salt`), whose KV differs from the base model's for the same tokens."""
    out: list[int] = []
    parent = salt
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        parent = hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        out.append(parent)
    return tuple(out)


def adapter_salt(name: str) -> int:
    """The :func:`prefix_hashes` salt of adapter ``name``, the same in every process
    (Python's ``hash`` of a string is not)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little", signed=True)


def cached_tokens(matched_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """Prompt tokens a replica likely holds, given how many leading blocks of the prompt
    it was sent: whole blocks, never the last token (the replica always computes it)."""
    return min(matched_blocks * block_size, max(0, prompt_tokens - 1))


class PrefixMap:
    """Prefix name -> the replicas it was last sent to, bounded to ``max_entries`` names
    (:data:`ENTRIES_PER_KV_BLOCK` per KV block of the replicas once they reported their
    capacity through :meth:`fit`; ``limit`` before, and at most).

    Not thread-safe: the router calls it under its lock.
    """

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.limit = max_entries
        self.max_entries = max_entries
        self._replicas: OrderedDict[int, set[Hashable]] = OrderedDict()
        self._kv_blocks: dict[Hashable, int] = {}
        """Each replica's KV blocks, as last reported to :meth:`fit`."""

    def fit(self, replica: Hashable, kv_blocks: int) -> None:
        """``replica`` holds ``kv_blocks`` KV blocks: bound the names to
        :data:`ENTRIES_PER_KV_BLOCK` per block of all the replicas reported, within
        ``[MIN_ENTRIES, limit]``."""
        if self._kv_blocks.get(replica) == kv_blocks:
            return
        self._kv_blocks[replica] = kv_blocks
        self._refit()

    def _refit(self) -> None:
        wanted = ENTRIES_PER_KV_BLOCK * sum(self._kv_blocks.values())
        self.max_entries = min(self.limit, max(MIN_ENTRIES, wanted))
        while len(self._replicas) > self.max_entries:
            self._replicas.popitem(last=False)

    def __len__(self) -> int:
        return len(self._replicas)

    def record(self, hashes: Sequence[int], replica: Hashable) -> None:
        """``replica`` was sent a prompt with these leading block hashes."""
        for h in hashes:
            holders = self._replicas.get(h)
            if holders is None:
                holders = self._replicas[h] = set()
            else:
                self._replicas.move_to_end(h)
            holders.add(replica)
        while len(self._replicas) > self.max_entries:
            self._replicas.popitem(last=False)

    def matched_blocks(self, hashes: Sequence[int]) -> dict[Hashable, int]:
        """For each replica that was sent a prefix of these hashes, how many leading
        blocks it was sent (only replicas with at least one)."""
        out: dict[Hashable, int] = {}
        for i, h in enumerate(hashes):
            holders = self._replicas.get(h)
            if not holders:
                break
            for r in holders:
                out[r] = i + 1
        return out

    def forget(self, replica: Hashable) -> None:
        """Drop a replica (it died: its cache is gone)."""
        if self._kv_blocks.pop(replica, None) is not None:
            self._refit()
        for h in [h for h, holders in self._replicas.items() if replica in holders]:
            self._replicas[h].discard(replica)
            if not self._replicas[h]:
                del self._replicas[h]
