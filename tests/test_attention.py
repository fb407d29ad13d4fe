"""SDPA paged attention: decodes grouped by context length attend exactly their own context."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine.layers.attention import (
    DECODE_SPLIT_SLOTS,
    AttentionMetadata,
    DecodeGroup,
    decode_groups,
    paged_attention,
)


def test_one_long_context_gets_its_own_group():
    assert decode_groups([600] + [100] * 23) == [(0, 1), (1, 24)]


def test_similar_contexts_share_one_group():
    assert decode_groups([120, 110, 100, 100]) == [(0, 4)]
    assert decode_groups([]) == []


def test_a_split_needs_more_than_the_threshold_of_padding():
    waste = DECODE_SPLIT_SLOTS // 2  # two shorter decodes, each padded by `waste`
    assert decode_groups([300, 300 - waste, 300 - waste]) == [(0, 3)]
    assert decode_groups([300, 299 - waste, 299 - waste]) == [(0, 1), (1, 3)]


def test_unsorted_contexts_are_refused():
    with pytest.raises(ValueError, match="longest first"):
        decode_groups([10, 20])


class _Layer(torch.nn.Module):
    layer_idx = 0


def test_grouped_decodes_match_dense_attention_per_sequence():
    torch.manual_seed(0)
    bs, kvh, heads, d = 4, 2, 4, 8
    contexts = [600, 9, 7, 5]  # longest first, as the runner orders decodes
    groups = decode_groups(contexts)
    assert len(groups) == 2, groups
    blocks = [math.ceil(c / bs) for c in contexts]
    first = [sum(blocks[:i]) for i in range(len(blocks))]
    k_cache = torch.randn(sum(blocks), bs, kvh, d)
    v_cache = torch.randn(sum(blocks), bs, kvh, d)

    def slots(i: int, n: int) -> torch.Tensor:
        """Flat cache slots of sequence i's first n positions (contiguous blocks)."""
        return torch.arange(n) + first[i] * bs

    md = AttentionMetadata(
        kv_caches=[(k_cache, v_cache)],
        slot_mapping=torch.stack([slots(i, c)[-1] for i, c in enumerate(contexts)]),
        query_start_loc=torch.arange(len(contexts) + 1, dtype=torch.int32),
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        block_tables=torch.zeros(len(contexts), max(blocks), dtype=torch.int32),
        max_query_len=1,
        max_context_len=max(contexts),
        num_decodes=len(contexts),
    )
    for start, end in groups:
        width = contexts[start]
        rows = [
            torch.cat([slots(i, contexts[i]), slots(i, 1).expand(width - contexts[i])])
            for i in range(start, end)
        ]
        lens = torch.tensor(contexts[start:end])
        md.decode_groups.append(
            DecodeGroup(
                start,
                end,
                torch.stack(rows),
                (torch.arange(width)[None, :] < lens[:, None]).view(end - start, 1, 1, width),
            )
        )
    t = len(contexts)
    q = torch.randn(1, heads, t, d)
    k_new, v_new = torch.randn(1, kvh, t, d), torch.randn(1, kvh, t, d)
    out, _ = paged_attention(_Layer(), q, k_new, v_new, None, scaling=d**-0.5, attn_metadata=md)

    k_flat, v_flat = k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)
    for i, c in enumerate(contexts):
        s = slots(i, c)
        ref = F.scaled_dot_product_attention(
            q[:, :, i : i + 1],
            k_flat[s].transpose(0, 1)[None],
            v_flat[s].transpose(0, 1)[None],
            scale=d**-0.5,
            enable_gqa=True,
        )
        torch.testing.assert_close(out[0, i], ref[0, :, 0], msg=f"decode {i} (context {c})")
