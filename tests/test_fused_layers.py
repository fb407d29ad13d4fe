"""Fused q/k/v, gate/up and RMSNorm layers (engine.layers.fused) against transformers' own."""

from __future__ import annotations

import copy

import pytest
import torch

import engine.model.runner  # noqa: F401  (registers the paged attention with transformers)
from engine.layers.attention import ATTN_IMPLEMENTATION, AttentionMetadata, PrefillChunk
from engine.layers.fused import FusedAttention, FusedMLP, RMSNorm, fuse_layers

BLOCK = 4


def tiny_model(arch: str, head_dim: int | None = None):
    """Two random layers of ``arch``; ``head_dim`` (Llama) overrides hidden / heads (8)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    extra = {} if head_dim is None else {"head_dim": head_dim}
    cfg = {
        "llama": lambda: LlamaConfig(**common, **extra),
        "qwen2": lambda: Qwen2Config(**common),  # q/k/v with bias
        "qwen3": lambda: Qwen3Config(head_dim=8, **common),
    }[arch]()  # per-head q/k norms
    cfg._attn_implementation = ATTN_IMPLEMENTATION
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms start at ones and biases at zero: vary them
            p.add_(torch.randn_like(p) * 0.1)
    return model


def prefill_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[T, vocab]`` of one prefill of ``ids`` through the paged attention."""
    cfg, t = model.config, len(ids)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    blocks = -(-t // BLOCK)
    shape = (blocks, BLOCK, cfg.num_key_value_heads, head_dim)
    md = AttentionMetadata(
        kv_caches=[(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)],
        slot_mapping=torch.arange(t),
        query_start_loc=torch.tensor([0, t], dtype=torch.int32),
        context_lens=torch.tensor([t], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        max_query_len=t,
        max_context_len=t,
        num_decodes=0,
        prefills=[PrefillChunk(0, t, None, None)],
    )
    with torch.inference_mode():
        return model(
            input_ids=ids[None],
            position_ids=torch.arange(t)[None],
            use_cache=False,
            attn_metadata=md,
        ).logits[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_model_equals_transformers_layers(arch):
    model = tiny_model(arch)
    fused = copy.deepcopy(model)
    assert fuse_layers(fused) == 2
    layer = fused.model.layers[0]
    assert isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedMLP)
    assert isinstance(layer.input_layernorm, RMSNorm) and isinstance(fused.model.norm, RMSNorm)
    ids = torch.randint(0, 64, (11,))
    torch.testing.assert_close(
        prefill_logits(fused, ids), prefill_logits(model, ids), rtol=1e-5, atol=1e-5
    )


def test_fusing_refuses_a_layer_without_linear_projections():
    model = tiny_model("llama")
    model.model.layers[1].self_attn.k_proj = torch.nn.Identity()
    with pytest.raises(ValueError, match="k_proj"):
        fuse_layers(model)


def test_fusing_refuses_a_norm_without_an_epsilon():
    model = tiny_model("llama")
    model.model.norm = torch.nn.LayerNorm(48)
    with pytest.raises(ValueError, match="variance_epsilon"):
        fuse_layers(model)
