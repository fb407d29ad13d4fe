"""Qwen2 and Mistral directories run through the same engine (tiny random weights)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

# (config class, model class, expected max_model_len): Qwen2's window is off by default
# (use_sliding_window=False); Mistral's applies, so the engine caps the context at it.
ARCHS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", 1024),
    "mistral": ("MistralConfig", "MistralForCausalLM", 512),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_matches_transformers(arch, tmp_path, tokenizer, prompts):
    import transformers

    config_name, model_name, expected_len = ARCHS[arch]
    config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        sliding_window=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    llm = LLM(model=str(tmp_path), max_num_batched_tokens=64)
    assert llm.llm_engine.max_model_len == expected_len
    chosen = [p for p in prompts if len(p) <= 400][::3]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in chosen], params, use_tqdm=False)
    with torch.inference_mode():
        for p, out in zip(chosen, outs):
            ref = model.generate(
                torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False
            )
            assert out.outputs[0].token_ids == ref[0, len(p) :].tolist()
