"""The reference ``flash_attn_varlen_func`` (tests/flash_reference.py) against dense SDPA,
and the argument contract it enforces as the real kernel would."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.flash_reference import ContractError, ReferenceFlashAttn

H, KVH, D, BS = 9, 3, 64, 256


def paged_batch(ctx_lens: list[int], q_lens: list[int], num_blocks: int = 12, seed: int = 0):
    """Random K/V for each sequence's context, written to shuffled cache blocks; the queries
    are the last ``q_lens[b]`` positions of sequence ``b``.

    Returns (kwargs for the reference, the dense per-sequence (q, k, v) ``[L, H|KVH, D]``)."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(num_blocks, BS, KVH, D)
    v_cache = torch.zeros(num_blocks, BS, KVH, D)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, dense, qs = [], [], []
    for n, lq in zip(ctx_lens, q_lens):
        k = torch.randn(n, KVH, D, generator=g)
        v = torch.randn(n, KVH, D, generator=g)
        q = torch.randn(lq, H, D, generator=g)
        blocks = [free.pop() for _ in range(-(-n // BS))]
        for i, b in enumerate(blocks):
            part = slice(i * BS, min(n, (i + 1) * BS))
            k_cache[b, : part.stop - part.start] = k[part]
            v_cache[b, : part.stop - part.start] = v[part]
        tables.append(blocks)
        dense.append((q, k, v))
        qs.append(q)
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    kwargs = dict(
        q=torch.cat(qs),
        k=k_cache,
        v=v_cache,
        cu_seqlens_q=cu(q_lens),
        cu_seqlens_k=cu(ctx_lens),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(ctx_lens),
        softmax_scale=D**-0.5,
        causal=True,
        block_table=block_table,
    )
    return kwargs, dense


def dense_attention(q, k, v):
    """SDPA over the whole sequence, keeping the rows of ``q``'s (the last) positions."""
    n, lq = k.shape[0], q.shape[0]
    full_q = torch.zeros(n, H, D)
    full_q[n - lq :] = q
    out = F.scaled_dot_product_attention(
        full_q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        is_causal=True,
        enable_gqa=True,
    )
    return out.transpose(0, 1)[n - lq :]


def test_reference_equals_dense_causal_attention_for_prefills_chunks_and_decodes():
    # A whole prompt over two blocks, a chunk starting mid-prompt, and two decodes.
    ctx, lq = [300, 520, 17, 700], [300, 64, 1, 1]
    kwargs, dense = paged_batch(ctx, lq)
    out = ReferenceFlashAttn()(**kwargs)
    assert out.shape == (sum(lq), H, D)
    start = 0
    for (q, k, v), n in zip(dense, lq):
        torch.testing.assert_close(out[start : start + n], dense_attention(q, k, v))
        start += n


def _break(name):
    def apply(kw):
        if name == "cu_seqlens_k int64":
            kw["cu_seqlens_k"] = kw["cu_seqlens_k"].long()
        elif name == "block_table int64":
            kw["block_table"] = kw["block_table"].long()
        elif name == "block_table not contiguous":
            kw["block_table"] = kw["block_table"].t().contiguous().t()
        elif name == "block size 16":
            kw["k"] = kw["k"].view(-1, 16, KVH, D)
            kw["v"] = kw["v"].view(-1, 16, KVH, D)
        elif name == "max_seqlen_k short":
            kw["max_seqlen_k"] -= 1
        elif name == "block id outside the cache":
            kw["block_table"][0, 0] = kw["k"].shape[0]
        elif name == "fewer keys than queries":
            kw["cu_seqlens_k"] = kw["cu_seqlens_k"] // 4
        elif name == "q and k dtypes differ":
            kw["q"] = kw["q"].half()
        return kw

    return apply


BROKEN = [
    "cu_seqlens_k int64",
    "block_table int64",
    "block_table not contiguous",
    "block size 16",
    "max_seqlen_k short",
    "block id outside the cache",
    "fewer keys than queries",
    "q and k dtypes differ",
]


@pytest.mark.parametrize("name", BROKEN)
def test_reference_refuses_what_the_kernel_refuses(name):
    kwargs, _ = paged_batch([300, 40], [300, 40])
    with pytest.raises(ContractError):
        ReferenceFlashAttn()(**_break(name)(kwargs))


def test_reference_refuses_fp32_unless_allowed():
    kwargs, _ = paged_batch([20], [20])
    with pytest.raises(ContractError, match="fp16 and bf16"):
        ReferenceFlashAttn(allow_fp32=False)(**kwargs)
    half = {**kwargs, "q": kwargs["q"].bfloat16(), "k": kwargs["k"].bfloat16()}
    half["v"] = kwargs["v"].bfloat16()
    assert ReferenceFlashAttn(allow_fp32=False)(**half).dtype == torch.bfloat16
