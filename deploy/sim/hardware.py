"""Published figures of the models and GPUs the roofline cost model knows.

Models (dense decoders; bf16 weights and KV cache, 2 bytes a value):

* ``0.5b``: Qwen2.5-0.5B, Qwen2.5 Technical Report (arXiv 2412.15115), Table 1: 24
  layers, 14 query and 2 KV heads, tied embeddings, 32K context; hidden size 896,
  intermediate 4864, head dim 64, vocabulary 151,936 from its released ``config.json``.
* ``8b``: Llama 3.1 8B, "The Llama 3 Herd of Models" (arXiv 2407.21783), Table 3: 32
  layers, model dimension 4096, FFN dimension 14,336, 32 heads, 8 KV heads, vocabulary
  128K (128,256 in the released config), 128K context.
* ``70b``: Llama 3.1 70B, the same table: 80 layers, 8192, 28,672, 64 heads, 8 KV heads.

GPUs (dense bf16 Tensor Core peak, without the 2:4 sparsity the datasheets also quote):

* ``h100-sxm``: NVIDIA H100 Tensor Core GPU datasheet: 989 TFLOP/s bf16 (1,979 with
  sparsity), 3.35 TB/s HBM3, 80 GB.
* ``h200``: NVIDIA H200 Tensor Core GPU datasheet: 989 TFLOP/s bf16 (1,979 with
  sparsity), 4.8 TB/s HBM3e, 141 GB.

Parameter counts are derived from the dimensions (:attr:`ModelSpec.layer_params`); they
reproduce the published totals (0.36B non-embedding for 0.5B, 8.0B, 70.6B).
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES_BF16 = 2


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int
    max_model_len: int
    tied_embeddings: bool

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer: q, k, v, o projections and a gated MLP."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        return 2 * q + kv + 3 * self.hidden * self.intermediate

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies through (the LM head only samples: not here)."""
        return self.layers * self.layer_params

    @property
    def params(self) -> int:
        embeddings = self.vocab_size * self.hidden * (1 if self.tied_embeddings else 2)
        return self.matmul_params + embeddings

    @property
    def weight_bytes(self) -> int:
        return self.params * BYTES_BF16

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * BYTES_BF16


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    peak_flops: float
    """Dense bf16 FLOP/s."""
    bandwidth_bytes_s: float
    memory_bytes: float


MODELS = {
    "0.5b": ModelSpec("Qwen2.5-0.5B", 24, 896, 14, 2, 64, 4864, 151_936, 32_768, True),
    "8b": ModelSpec("Llama-3.1-8B", 32, 4096, 32, 8, 128, 14_336, 128_256, 131_072, False),
    "70b": ModelSpec("Llama-3.1-70B", 80, 8192, 64, 8, 128, 28_672, 128_256, 131_072, False),
}
GPUS = {
    "h100-sxm": GpuSpec("H100 SXM", 989e12, 3.35e12, 80e9),
    "h200": GpuSpec("H200", 989e12, 4.8e12, 141e9),
}
