"""The flash-attn path of the runner, on CPU, with a reference ``flash_attn_varlen_func``.

``attention_backend="flash_attn"`` with ``block_size`` 256 runs every step through the
plumbing that flash-attn sees on a GPU (the paged cache, int32 block tables and cumulative
lengths, decodes and chunks mixed in one call), with :class:`tests.flash_reference.
ReferenceFlashAttn` standing in for the kernel. Its greedy output must equal the default
CPU path's (the CPU kernels, ``block_size`` 16) token for token, except at a near tie of the
default path's top-2 log-probabilities.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cpu.linear import PackedLinear
from engine.model.attention_backend import select_attention_backend
from engine.model.runner import TorchModelRunner
from tests.flash_reference import ContractError, ReferenceFlashAttn

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
NEAR_TIE = 1e-4
# 1 to 700 tokens: one to three 256-token blocks, decodes and chunks in one step.
HELD = [0, 6, 16, 20, 23]


@pytest.fixture(scope="module")
def held(prompts) -> list[list[int]]:
    return [prompts[i] for i in HELD]


def flash_llm(**config) -> tuple[LLM, ReferenceFlashAttn]:
    ref = ReferenceFlashAttn()
    llm = LLM(attention_backend="flash_attn", block_size=256, flash_attn_varlen_func=ref, **config)
    assert llm.llm_engine.runner.use_flash
    return llm, ref


def greedy(llm: LLM, prompts: list[list[int]], **params) -> list:
    params = SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0, **params})
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    return LLM()


@pytest.fixture(scope="module")
def default_out(default_llm, held):
    """The default CPU path's greedy outputs, with the top-2 log-probabilities per token."""
    return greedy(default_llm, held, logprobs=2)


def assert_same_greedy(got, expected) -> None:
    """Token-for-token equality; a divergence only where ``expected``'s top-2
    log-probabilities are within :data:`NEAR_TIE`."""
    for i, (a, b) in enumerate(zip(got, expected)):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        for pos, (x, y) in enumerate(zip(ta, tb)):
            if x != y:
                top = sorted(b.outputs[0].logprobs[pos].values(), reverse=True)
                gap = top[0] - top[1]
                assert gap < NEAR_TIE, f"prompt {i} diverges at token {pos}: gap {gap:.3g}"
                break
        else:
            assert ta == tb, f"prompt {i}: {ta} != {tb}"


def assert_blocks_free(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check()


FLASH_CONFIGS = {
    # Chunks of 16 beside decodes, up to 64 requests a step.
    "chunk-16": dict(max_num_batched_tokens=64, long_prefill_token_threshold=16, max_num_seqs=64),
    # One request at a time, each prompt in one chunk.
    "max_num_seqs-1": dict(max_num_seqs=1),
}


@pytest.mark.parametrize("name", list(FLASH_CONFIGS))
def test_flash_path_greedy_equals_the_default_path(name, held, default_out):
    # Up to 440 tokens: two blocks, and 16-token chunks that cross a block boundary.
    llm, ref = flash_llm(**FLASH_CONFIGS[name])
    out = greedy(llm, held[:4])
    assert ref.calls > 0
    assert_same_greedy(out, default_out[:4])
    assert_blocks_free(llm)


def test_flash_path_in_bfloat16_passes_the_kernels_dtype_contract(held):
    """The GPU's dtype: the reference refuses fp32 here, as flash-attn does, so the
    queries and the cache must reach it in bfloat16."""
    ref = ReferenceFlashAttn(allow_fp32=False)
    llm = LLM(
        attention_backend="flash_attn",
        block_size=256,
        dtype="bfloat16",
        flash_attn_varlen_func=ref,
        cpu_weight_prepack=False,
    )
    out = greedy(llm, held[:3], max_tokens=4)
    assert ref.calls > 0
    assert all(o.outputs[0].finish_reason in ("length", "stop") for o in out)
    assert_blocks_free(llm)


def test_sdpa_backend_at_block_256_equals_the_default_path(held, default_out):
    """What a GPU without flash-attn runs: SDPA (``auto`` on CUDA picks it then) and
    torch's own ``nn.Linear`` (no oneDNN prepacking)."""
    llm = LLM(
        attention_backend="sdpa",
        block_size=256,
        max_num_batched_tokens=256,
        cpu_weight_prepack=False,
    )
    runner = llm.llm_engine.runner
    assert runner.attention.name == "sdpa"
    assert not any(isinstance(m, PackedLinear) for m in runner.model.modules())
    assert_same_greedy(greedy(llm, held), default_out)
    assert_blocks_free(llm)


def test_flash_path_preemption_and_recompute_at_chunk_64(held, default_llm):
    """Three blocks hold a 250- and a 505-token prompt; the shorter one's decode needs a
    fourth block within a few tokens, so the other is preempted and recomputed."""
    prompts = [held[-1][:250], held[-1][100:605]]
    llm, _ = flash_llm(num_kv_blocks=3, max_num_batched_tokens=256, long_prefill_token_threshold=64)
    out = greedy(llm, prompts)
    assert llm.llm_engine.scheduler.num_preemptions > 0, "three blocks should preempt"
    assert_same_greedy(out, greedy(default_llm, prompts, logprobs=2))
    assert_blocks_free(llm)


def test_flash_path_prefix_hits_share_a_block_at_a_chunk_boundary(held, default_llm):
    """Two requests share the first 256-token block of a finished one's prompt and run side
    by side; each one's first chunk starts at that block's end (a chunk boundary) and
    attends to the shared block."""
    base = (held[-1] * 2)[:600]
    tails = [held[3][:40], held[4][:90]]
    later = [base[:256] + t for t in tails]
    llm, _ = flash_llm(max_num_batched_tokens=256, long_prefill_token_threshold=64)
    first = greedy(llm, [base])
    bm = llm.llm_engine.block_manager
    hits_before = bm.num_hit_tokens
    shared = greedy(llm, later)
    assert bm.num_hit_tokens - hits_before == 2 * 256, "each later request hits one block"
    expected = greedy(default_llm, [base, *later], logprobs=2)
    assert_same_greedy(first + shared, expected)
    assert_blocks_free(llm)


def test_flash_path_prompt_logprobs_across_chunks(held, default_llm):
    prompts = [held[-2]]  # 440 tokens: seven chunks of 64 over two blocks
    llm, _ = flash_llm(max_num_batched_tokens=128, long_prefill_token_threshold=64)
    got = greedy(llm, prompts, prompt_logprobs=1, max_tokens=1)
    expected = greedy(default_llm, prompts, prompt_logprobs=1, max_tokens=1)
    for a, b in zip(got, expected):
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        assert len(a.prompt_logprobs) == len(a.prompt_token_ids)
        for pos, (la, lb) in enumerate(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]), 1):
            token = a.prompt_token_ids[pos]
            assert la[token] == pytest.approx(lb[token], abs=1e-3), f"prompt token {pos}"


def test_flash_path_structured_output(default_llm):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
        "required": ["city", "year"],
    }
    prompt = "Reply in JSON with a city and the year it was founded."
    params = SamplingParams(max_tokens=48, temperature=0, json_schema=schema)
    llm, ref = flash_llm()
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    expected = default_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert ref.calls > 0
    assert got.token_ids == expected.token_ids
    if got.finish_reason == "stop":
        assert set(json.loads(got.text)) >= {"city", "year"}


def _shift_context(md) -> None:
    md.cu_seqlens_k = md.cu_seqlens_k - torch.arange(len(md.cu_seqlens_k), dtype=torch.int32)


def _roll_tables(md) -> None:
    md.block_tables = md.block_tables.roll(1, dims=0).contiguous()


@pytest.mark.parametrize("mutate", [_shift_context, _roll_tables], ids=["cu_seqlens_k", "tables"])
def test_a_wrong_runner_fails_the_flash_path_check(mutate, monkeypatch, held, default_out):
    """The check above can fail: a runner that hands flash-attn one key too few per
    sequence, or another sequence's block table, is caught (by the reference's contract or
    by the outputs)."""
    prepare = TorchModelRunner._prepare

    def wrong(self, out):
        prepared = prepare(self, out)
        mutate(prepared[2])
        return prepared

    monkeypatch.setattr(TorchModelRunner, "_prepare", wrong)
    llm, _ = flash_llm(max_num_batched_tokens=256, long_prefill_token_threshold=64)
    try:
        out = greedy(llm, held[2:])
    except ContractError:
        return
    with pytest.raises(AssertionError):
        assert_same_greedy(out, default_out[2:])


def test_the_flash_backend_is_refused_where_it_cannot_run():
    cpu, f32 = torch.device("cpu"), torch.float32
    with pytest.raises(ValueError, match="flash-attn package"):
        select_attention_backend("flash_attn", cpu, f32, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        select_attention_backend("flash_attn", cpu, f32, 16, ReferenceFlashAttn())
    with pytest.raises(ValueError, match="given with attention_backend 'sdpa'"):
        select_attention_backend("sdpa", cpu, f32, 256, ReferenceFlashAttn())
    with pytest.raises(ValueError, match="cpu_kernels"):
        select_attention_backend("cpu_kernels", cpu, torch.bfloat16, 16)
    assert select_attention_backend("auto", cpu, f32, 256, ReferenceFlashAttn()).name == (
        "flash_attn"
    )
