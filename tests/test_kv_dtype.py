"""A KV cache of float16 or bfloat16 (``kv_cache_dtype``): the kernels store rounded values
and read them as the fp32 kernels read the same values, and the engine's greedy tokens stay
those of a float32 cache but where the rounding moves a near tie."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.cpu.kernels import load

kernels = load()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler for engine.cpu.kernels")
HALF = [torch.float16, torch.bfloat16]


@needs_kernels
@pytest.mark.parametrize("dtype", HALF)
def test_cache_write_rounds_to_nearest(dtype):
    k, v = torch.randn(21, 40) * 3, torch.randn(21, 40)
    kc, vc = torch.zeros(30, 40, dtype=dtype), torch.zeros(30, 40, dtype=dtype)
    slots = torch.randperm(30)[:21]
    kernels.cache_write(k, v, slots, kc, vc)
    assert torch.equal(kc[slots], k.to(dtype)) and torch.equal(vc[slots], v.to(dtype))


def _paged(dtype, lens, kv_heads, d, bs=4):
    torch.manual_seed(0)
    need = [-(-n // bs) for n in lens]
    kc, vc = (torch.randn(sum(need) + 2, bs, kv_heads, d).to(dtype) for _ in range(2))
    perm = torch.randperm(len(kc)).int()
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    off = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[off : off + n]
        off += n
    return kc, vc, tables, torch.tensor(lens, dtype=torch.int32)


@needs_kernels
@pytest.mark.parametrize("dtype", HALF)
def test_attention_on_a_16_bit_cache_is_the_fp32_kernels_on_its_values(dtype):
    """Bit for bit: a 16-bit row is converted to fp32, then the fp32 loops run on it."""
    kc, vc, tables, lens = _paged(dtype, [700, 333, 1], kv_heads=2, d=64)
    q = torch.randn(3, 6, 64)
    got, want = torch.empty_like(q), torch.empty_like(q)
    kernels.decode_attention(q, kc, vc, tables, lens, 0.3, got)
    kernels.decode_attention(q, kc.float(), vc.float(), tables, lens, 0.3, want)
    assert torch.equal(got, want)
    qsl = torch.tensor([0, 40, 49, 50], dtype=torch.int32)
    q = torch.randn(50, 6, 64)
    got, want = torch.zeros_like(q), torch.zeros_like(q)
    kernels.prefill_attention(q, kc, vc, tables, qsl, lens, 0, 0.3, got)
    kernels.prefill_attention(q, kc.float(), vc.float(), tables, qsl, lens, 0, 0.3, want)
    assert torch.equal(got, want)


def test_kv_cache_dtype_auto_is_the_model_dtype_and_flash_refuses_another():
    assert EngineConfig().torch_kv_dtype() == EngineConfig().torch_dtype()
    assert EngineConfig(kv_cache_dtype="bfloat16").torch_kv_dtype() == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(
            attention_backend="flash_attn",
            block_size=256,
            kv_cache_dtype="float16",
            flash_attn_varlen_func=lambda *a, **k: None,
        )


GAP = 0.01
"""Top-2 log-probability gap (nats) below which a 16-bit cache may flip a greedy token:
the rounding of K and V (relative 2^-11 for float16, 2^-8 for bfloat16) moves the logits
by about that much on this model."""


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_greedy_tokens_equal_a_float32_cache_but_at_near_ties(kv, prompts):
    outs = {}
    for dtype in ("float32", kv):
        llm = LLM(kv_cache_dtype=dtype, num_kv_blocks=400, max_num_batched_tokens=97)
        assert llm.llm_engine.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
        sp = SamplingParams(max_tokens=16, temperature=0, logprobs=2)
        outs[dtype] = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        llm.llm_engine.block_manager.check()
    for i, (ref, got) in enumerate(zip(outs["float32"], outs[kv])):
        a, b = ref.outputs[0].token_ids, got.outputs[0].token_ids
        if a != b:
            pos = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            top2 = sorted(ref.outputs[0].logprobs[pos].values(), reverse=True)[:2]
            assert top2[0] - top2[1] < GAP, f"prompt {i} token {pos}: gap {top2[0] - top2[1]}"
