"""The flash-attn path on CUDA (skipped without CUDA and flash-attn)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

# bf16 logits are coarse: a divergence is accepted at a top-2 gap below this.
BF16_NEAR_TIE = 0.1


def test_flash_attn_greedy_matches_transformers_on_cuda(model_dir, prompts):
    from transformers import AutoModelForCausalLM

    llm = LLM(
        str(model_dir), device="cuda", dtype="bfloat16", block_size=256, max_num_batched_tokens=256
    )
    assert llm.llm_engine.runner.use_flash
    params = SamplingParams(max_tokens=16, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    for p, out in zip(prompts, outs):
        ref = ref_model.generate(
            torch.tensor([p], device="cuda"),
            max_new_tokens=16,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        ref_ids = ref.sequences[0, len(p) :].tolist()
        got = out.outputs[0].token_ids
        for pos, (a, b) in enumerate(zip(got, ref_ids)):
            if a != b:
                top2 = ref.logits[pos][0].float().topk(2).values
                assert float(top2[0] - top2[1]) < BF16_NEAR_TIE
                break
        else:
            assert got == ref_ids
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
