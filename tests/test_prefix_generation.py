"""Greedy output with prefix caching on equals output with it off and transformers'
``generate``, token for token, for prompts that share prefixes of every length around
the 16-token block boundaries."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.test_generation import assert_matches_reference, greedy_reference

BLOCK = 16
MAX_TOKENS = 8
"""Enough decodes to read the prefill's KV back; the prompts are what is under test."""
SHARED = [1, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65]
"""Lengths of the prefix each variant shares with the base prompt."""


@pytest.fixture(scope="module")
def shared_prompts(prompts) -> list[list[int]]:
    """A 90-token base prompt, the base itself, its 64-token head (a prompt that is
    whole cached blocks), then one variant per length in SHARED: the base's first
    tokens and a 9-token tail of its own."""
    base = prompts[-1][:90]
    tails = prompts[-2]
    out = [base, list(base), base[:64]]
    for i, k in enumerate(SHARED):
        out.append(base[:k] + tails[9 * i : 9 * i + 9])
    return out


@pytest.fixture(scope="module")
def shared_reference(model_dir, shared_prompts):
    return greedy_reference(model_dir, shared_prompts, MAX_TOKENS)


def expected_cached(prompt: list[int], base: list[int]) -> int:
    """Tokens a prompt finds cached once ``base`` has run: its common prefix with the
    base, in whole blocks, leaving at least its last token to compute."""
    common = 0
    while common < min(len(prompt), len(base)) and prompt[common] == base[common]:
        common += 1
    return min(common, len(prompt) - 1) // BLOCK * BLOCK


CASES = {
    # One request at a time: every variant runs after the base, so its hits are exact.
    "sequential": dict(max_num_seqs=1),
    # All at once under a small budget: variants are admitted while the base and each
    # other are still being prefilled in 24-token chunks, which end inside blocks, and
    # reuse the blocks those chunks have filled (never one they have only begun).
    "concurrent-chunked": dict(max_num_batched_tokens=24, long_prefill_token_threshold=24),
    # The server's budget: the prompts (728 tokens) take two steps, and those admitted in
    # the second reuse the blocks of the first step's prompts.
    "concurrent": dict(max_num_batched_tokens=512),
}


def generate(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("case", list(CASES))
def test_cached_output_equals_uncached_and_transformers(case, shared_prompts, shared_reference):
    on = LLM(**CASES[case])
    cached = generate(on, shared_prompts)
    bm = on.llm_engine.block_manager
    assert bm.num_hit_tokens > 0, "no prefix was reused"
    assert bm.num_free_blocks == bm.num_blocks
    bm.check()
    assert_matches_reference(cached, shared_reference)
    off = LLM(enable_prefix_caching=False, **CASES[case])
    plain = generate(off, shared_prompts)
    assert off.llm_engine.block_manager.num_hit_tokens == 0
    for a, b in zip(cached, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.num_cached_tokens == 0
    if case == "sequential":
        base = shared_prompts[0]
        assert [o.num_cached_tokens for o in cached] == (
            [0] + [expected_cached(p, base) for p in shared_prompts[1:]]
        )
    del on, off
