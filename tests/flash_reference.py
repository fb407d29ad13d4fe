"""A reference ``flash_attn_varlen_func`` in plain PyTorch, for the flash-attn path on CPU.

Written from flash-attn 2's documented contract (the docstring of
``flash_attn_interface.flash_attn_varlen_func`` and the argument checks of ``mha_varlen_fwd``
in ``csrc/flash_attn/flash_api.cpp``, Dao-AILab/flash-attention v2.8), not from its code:

* ``q`` ``[total_q, H, D]``; with a ``block_table``, ``k`` and ``v`` are a paged cache
  ``[num_blocks, block_size, KVH, D]`` with ``block_size % 256 == 0``, and sequence ``b``'s
  keys are its first ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` slots along its row of
  ``block_table`` (``[batch, max_blocks]``);
* ``cu_seqlens_q``, ``cu_seqlens_k`` and ``block_table`` are int32; the cumulative lengths
  are contiguous, the block table's last dimension is;
* q, k and v share one dtype, fp16 or bf16 (fp32 is refused, unless ``allow_fp32``: the
  engine's CPU tests run in fp32); their last dimension is contiguous;
* ``causal`` aligns the mask to the bottom right: query ``i`` of a sequence with ``Lq``
  queries and ``Lk`` keys sees keys ``0 .. Lk - Lq + i``;
* GQA: query head ``h`` reads key/value head ``h // (H // KVH)``;
* the softmax runs in fp32 on ``softmax_scale * q @ k.T`` (default ``D ** -0.5``).

Beyond the kernel's own checks, the reference refuses what the kernel would compute wrong
without a word: a ``max_seqlen_q`` or ``max_seqlen_k`` below a real length, a sequence with
fewer keys than queries, a block index outside the cache, and too few blocks for the keys.
"""

from __future__ import annotations

import math

import torch

PAGED_BLOCK_MULTIPLE = 256


class ContractError(RuntimeError):
    """An argument the real kernel refuses (``TORCH_CHECK``), or computes wrong silently."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ContractError(message)


class ReferenceFlashAttn:
    """Callable as ``flash_attn_varlen_func``; counts its calls in :attr:`calls`.

    Args:
        allow_fp32: accept fp32 q/k/v (the real kernel takes fp16 and bf16 only).
    """

    def __init__(self, allow_fp32: bool = True) -> None:
        self.allow_fp32 = allow_fp32
        self.calls = 0

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        alibi_slopes: torch.Tensor | None = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        block_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.calls += 1
        self._check_args(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table)
        _check(
            dropout_p == 0.0
            and window_size == (-1, -1)
            and softcap == 0.0
            and alibi_slopes is None
            and not return_attn_probs,
            "the reference implements inference attention only (no dropout, window, "
            "softcap, ALiBi or returned probabilities)",
        )
        _check(block_table is not None, "the reference implements the paged layout only")
        assert block_table is not None
        total_q, num_heads, head_dim = q.shape
        num_blocks, block_size, num_kv_heads, _ = k.shape
        batch = cu_seqlens_q.numel() - 1
        cq = cu_seqlens_q.tolist()
        ck = cu_seqlens_k.tolist()
        _check(cq[0] == 0 and cq[-1] == total_q, f"cu_seqlens_q {cq} does not span {total_q}")
        _check(ck[0] == 0, f"cu_seqlens_k starts at {ck[0]}, not 0")
        scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        for b in range(batch):
            len_q, len_k = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            _check(0 <= len_q <= max_seqlen_q, f"sequence {b}: {len_q} queries, max {max_seqlen_q}")
            _check(0 < len_k <= max_seqlen_k, f"sequence {b}: {len_k} keys, max {max_seqlen_k}")
            _check(len_k >= len_q, f"sequence {b}: {len_k} keys for {len_q} queries")
            needed = math.ceil(len_k / block_size)
            _check(
                needed <= block_table.shape[1],
                f"sequence {b}: {len_k} keys need {needed} blocks, the table has "
                f"{block_table.shape[1]}",
            )
            blocks = block_table[b, :needed].long()
            _check(
                bool(((blocks >= 0) & (blocks < num_blocks)).all()),
                f"sequence {b}: block ids {blocks.tolist()} outside [0, {num_blocks})",
            )
            keys = k[blocks].reshape(-1, num_kv_heads, head_dim)[:len_k]
            values = v[blocks].reshape(-1, num_kv_heads, head_dim)[:len_k]
            keys = keys.float().repeat_interleave(group, dim=1)  # [Lk, H, D]
            values = values.float().repeat_interleave(group, dim=1)
            qb = q[cq[b] : cq[b + 1]].float()  # [Lq, H, D]
            scores = torch.einsum("qhd,khd->hqk", qb, keys) * scale
            if causal:
                q_pos = torch.arange(len_k - len_q, len_k)[:, None]
                hidden = torch.arange(len_k)[None, :] > q_pos  # [Lq, Lk]
                scores = scores.masked_fill(hidden.to(scores.device), float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[cq[b] : cq[b + 1]] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
        return out

    def _check_args(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        block_table: torch.Tensor | None,
    ) -> None:
        dtypes = (torch.float16, torch.bfloat16) + ((torch.float32,) if self.allow_fp32 else ())
        _check(q.dtype in dtypes, f"q dtype {q.dtype}: flash-attn takes fp16 and bf16")
        _check(k.dtype == q.dtype and v.dtype == q.dtype, "q, k and v must share a dtype")
        for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            _check(t.dtype == torch.int32, f"{name} must have dtype int32, not {t.dtype}")
            _check(t.is_contiguous() and t.dim() == 1, f"{name} must be contiguous and 1-D")
        devices = {t.device for t in (q, k, v, cu_seqlens_q, cu_seqlens_k)}
        _check(len(devices) == 1, f"tensors on several devices: {devices}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            _check(t.stride(-1) == 1, f"{name} must have a contiguous last dimension")
        _check(q.dim() == 3, f"q must be [total_q, H, D], not {tuple(q.shape)}")
        batch = cu_seqlens_q.numel() - 1
        _check(batch > 0, "batch size must be positive")
        _check(cu_seqlens_k.numel() == batch + 1, "cu_seqlens_q and cu_seqlens_k differ in size")
        _check(q.shape[2] <= 256, "head dimension at most 256")
        if block_table is None:
            return
        _check(block_table.device == q.device, "block_table on another device")
        _check(block_table.dtype == torch.int32, f"block_table dtype {block_table.dtype}")
        _check(block_table.stride(-1) == 1, "block_table must have a contiguous last dimension")
        _check(k.dim() == 4 and k.shape == v.shape, "paged k and v: [blocks, block_size, KVH, D]")
        _check(
            k.shape[1] % PAGED_BLOCK_MULTIPLE == 0,
            f"Paged KV cache block size must be divisible by 256, not {k.shape[1]}",
        )
        _check(k.shape[3] == q.shape[2], "q and k head dimensions differ")
        _check(q.shape[1] % k.shape[2] == 0, "KV heads must divide query heads")
        _check(
            block_table.dim() == 2 and block_table.shape[0] == batch,
            f"block_table must be [{batch}, max_blocks], not {tuple(block_table.shape)}",
        )
