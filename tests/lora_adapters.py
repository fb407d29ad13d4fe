"""Small random PEFT LoRA adapters of the embedded model, and their greedy references."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    model_dir: Path,
    path: Path,
    targets: list[str],
    rank: int,
    seed: int,
    prompts: list[list[int]] = (),
    max_new_tokens: int = 8,
    **config,
) -> list[list[int]]:
    """Save a random rank-``rank`` LoRA adapter of ``model_dir``'s model on ``targets`` in
    ``path`` (peft's ``init_lora_weights=False``: its default zero ``B`` would change
    nothing); the greedy tokens of transformers' ``generate`` on the merged model for each
    of ``prompts``. ``config``: more ``LoraConfig`` fields."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=targets,
        init_lora_weights=False,
        **config,
    )
    model = get_peft_model(base, lora)
    model.save_pretrained(path)
    merged = model.merge_and_unload().eval()
    refs = greedy(merged, prompts, max_new_tokens)
    del base, model, merged
    gc.collect()
    return refs


def greedy(model, prompts, max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy ``generate`` per prompt (unpadded)."""
    out = []
    with torch.inference_mode():
        for ids in prompts:
            seq = model.generate(
                torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False
            )
            out.append(seq[0, len(ids) :].tolist())
    return out
