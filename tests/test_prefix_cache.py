"""Prefix caching: the block manager's names, reference counts and eviction, and the
scheduler's reuse of cached blocks (no model; generation equality is in
``tests/test_prefix_generation.py``)."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.core.kv_cache import BlockManager
from engine.core.params import SamplingParams
from engine.core.request import FinishReason, Request
from engine.core.scheduler import Scheduler
from policies import FCFSPolicy
from tests.test_scheduler import FakeClock, fake_step

BS = 4


def take(bm: BlockManager, seq_id: str, tokens: list[int]) -> int:
    """Admit ``tokens`` as ``seq_id`` with its cached prefix, compute them, name the
    full blocks; return the cached tokens."""
    prefix = bm.cached_prefix(tokens)
    bm.allocate(seq_id, len(tokens), prefix)
    bm.commit(seq_id, tokens, len(tokens))
    bm.check()
    return len(prefix) * bm.block_size


def test_equal_prefixes_share_blocks_and_the_last_token_is_always_computed():
    bm = BlockManager(16, BS)
    a = list(range(10))  # two full blocks and a partial one
    assert take(bm, "a", a) == 0
    assert take(bm, "b", a + [99, 98]) == 8
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.block_table("b")[2] != bm.block_table("a")[2]  # partial blocks never shared
    # A prompt of exactly two full blocks that are cached: the second is recomputed.
    assert take(bm, "c", a[:8]) == 4
    # Equal tokens after a different first block are a different prefix.
    assert take(bm, "d", [7, 7, 7, 7] + a[4:10]) == 0


def test_only_blocks_whose_every_token_is_computed_are_named():
    # A chunked prefill can end inside a block: that block's KV is half written, and a
    # sequence that found it cached would read garbage.
    bm = BlockManager(8, BS)
    a = list(range(12))
    bm.allocate("a", 12)
    bm.commit("a", a, 6)
    assert len(bm.cached_prefix(a)) == 1
    bm.commit("a", a, 8)
    assert len(bm.cached_prefix(a)) == 2
    bm.check()


def test_reference_counts_and_freed_blocks_stay_cached_until_evicted():
    bm = BlockManager(6, BS)
    a = list(range(9))
    take(bm, "a", a)
    take(bm, "b", a)
    shared = bm.block_table("a")[:2]
    bm.free("a")
    bm.check()
    assert bm.num_free_blocks == 3  # b still holds the shared blocks and its own third
    bm.free("b")
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 2
    assert take(bm, "c", a) == 8 and bm.block_table("c")[:2] == shared
    bm.free("c")
    # Four fresh blocks come from the unnamed ones (two never used, two partial blocks)
    # before any cached block is evicted.
    take(bm, "e", list(range(100, 116)))
    assert bm.num_cached_blocks == 2 + 4 and bm.cached_prefix(a) == shared
    bm.free("e")
    bm.check()


def test_lru_eviction_order():
    bm = BlockManager(4, BS)
    x, y = list(range(5)), list(range(50, 55))
    take(bm, "x", x)
    take(bm, "y", y)
    bm.free("x")  # x's named block freed first: evicted first
    bm.free("y")
    assert bm.num_cached_blocks == 2
    take(bm, "z", list(range(200, 209)))  # needs 3 blocks: 2 unnamed partials + x's
    assert bm.cached_prefix(x) == [] and bm.cached_prefix(y) != []
    bm.free("z")
    bm.check()
    assert bm.num_free_blocks == 4


def test_cached_free_blocks_count_as_room_and_revived_blocks_are_counted():
    bm = BlockManager(3, BS)
    a = list(range(9))
    take(bm, "a", a)
    bm.free("a")
    prefix = bm.cached_prefix(a)
    assert len(prefix) == 2
    # Reviving two cached free blocks plus one new block takes all three free blocks.
    assert bm.num_new_blocks("b", 9, prefix) == 3 and bm.can_allocate("b", 9, prefix)
    assert not bm.can_allocate("b", 13, prefix)
    with pytest.raises(RuntimeError):
        bm.allocate("b", 13, prefix)
    bm.check()


def test_concurrent_duplicates_stay_unnamed_and_chains_continue():
    bm = BlockManager(16, BS)
    a = list(range(12))
    for sid in ("p", "q"):  # both admitted before either computed anything
        bm.allocate(sid, len(a), bm.cached_prefix(a))
    bm.commit("p", a, 12)
    bm.commit("q", a, 12)
    bm.check()
    p_table = list(bm.block_table("p"))
    assert bm.num_cached_blocks == 3 and bm.cached_prefix(a + [1]) == p_table
    # q's third block was a duplicate left unnamed; q's fourth block is still named,
    # chained on the third's hash (not on a name the block does not carry).
    bm.allocate("q", 17)
    bm.commit("q", a + [5, 6, 7, 8, 9], 16)
    assert bm.cached_prefix(a + [5, 6, 7, 8, 9]) == p_table + bm.block_table("q")[3:4]
    bm.free("p")
    bm.free("q")
    bm.check()
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 4


def test_salt_and_disabled_cache_never_match():
    a = list(range(9))
    other = BlockManager(8, BS, cache_salt="another-model")
    base = BlockManager(8, BS)
    take(base, "a", a)
    take(other, "a", a)
    assert base.block_table("a") and base._cached.keys().isdisjoint(other._cached.keys())
    off = BlockManager(8, BS, enable_prefix_caching=False)
    take(off, "a", a)
    off.free("a")
    assert take(off, "b", a) == 0 and off.num_cached_blocks == 0 and off.hit_rate == 0


def test_random_workload_never_leaks_and_invariants_hold():
    rng = random.Random(1)
    bm = BlockManager(40, BS)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(1, 20))] for _ in range(5)]
    live: dict[str, list[int]] = {}
    for i in range(400):
        if live and (rng.random() < 0.45 or len(live) > 6):
            bm.free(live.pop(rng.choice(list(live))))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 9))]
            prefix = bm.cached_prefix(tokens)
            if bm.can_allocate(str(i), len(tokens), prefix):
                bm.allocate(str(i), len(tokens), prefix)
                bm.commit(str(i), tokens, rng.randint(len(prefix) * BS, len(tokens)))
                live[str(i)] = str(i)
        bm.check()
    for sid in list(live):
        bm.free(sid)
    bm.check()
    assert bm.num_free_blocks == 40 and bm.usage == 0


# The scheduler over a caching block manager.


def make(num_blocks=100, **cfg):
    config = EngineConfig(block_size=BS, num_kv_blocks=num_blocks, **cfg)
    clock = FakeClock()
    return Scheduler(config, BlockManager(num_blocks, BS), FCFSPolicy(), clock), clock


def request(rid, tokens, max_tokens=3, **params):
    return Request(
        rid,
        list(tokens),
        SamplingParams(max_tokens=max_tokens, **params),
        arrival_time=0.0,
        max_tokens=max_tokens,
    )


def run(sched, clock):
    while sched.has_unfinished():
        fake_step(sched, clock)


def test_scheduler_prefills_only_the_uncached_suffix():
    sched, clock = make()
    shared = list(range(1000, 1021))  # 5 full blocks and one token
    sched.add(request("first", shared + [1, 2]))
    run(sched, clock)
    second = request("second", shared + [3, 4, 5])
    sched.add(second)
    out = fake_step(sched, clock)
    (seq,) = out.seqs
    assert (seq.start, seq.num_tokens) == (20, 4)
    assert second.num_cached_tokens == 20 and second.num_computed_tokens == 24
    run(sched, clock)
    bm = sched.block_manager
    assert bm.num_hit_tokens == 20 and bm.num_queried_tokens == 23 + 24
    assert bm.num_free_blocks == bm.num_blocks


def test_prompt_logprobs_requests_do_not_read_the_cache():
    sched, clock = make()
    tokens = list(range(1000, 1013))
    sched.add(request("first", tokens))
    run(sched, clock)
    scoring = request("scoring", tokens, prompt_logprobs=1)
    sched.add(scoring)
    out = fake_step(sched, clock)
    assert out.seqs[0].start == 0 and scoring.num_cached_tokens == 0


def test_preempted_request_recomputes_from_its_cached_blocks():
    # 12 blocks of 4 tokens; two requests of 16-token prompts and 20 outputs cannot both
    # finish in the cache, so one is preempted; its blocks stay cached and its
    # re-admission starts from them.
    sched, clock = make(num_blocks=12, max_num_batched_tokens=64)
    a = request("a", range(2000, 2016), max_tokens=20)
    b = request("b", range(3000, 3016), max_tokens=20)
    sched.add(a)
    sched.add(b)
    starts = []
    while sched.has_unfinished():
        out = fake_step(sched, clock)
        starts += [s.start for s in out.seqs if s.num_tokens > 1 and s.start > 0]
    assert sched.num_preemptions > 0
    assert starts and all(s % BS == 0 for s in starts)
    assert a.finish_reason is FinishReason.LENGTH and b.finish_reason is FinishReason.LENGTH
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0  # first admissions only
