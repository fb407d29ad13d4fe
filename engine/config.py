"""Engine configuration: one pydantic model for the CLI, YAML and the Python API."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies import SchedulingPolicy, policy_from_spec
from policies.slo_guard import RULES

GuardRule = Literal[RULES]
"""A name in ``policies.slo_guard.RULES``."""

DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30

FLASH_BLOCK_MULTIPLE = 256
"""flash-attn reads a paged cache only in blocks of a multiple of 256 tokens (its
``mha_varlen_fwd`` refuses others: "Paged KV cache block size must be divisible by 256")."""

BackendChoice = Literal["auto", "sdpa", "cpu_kernels", "flash_attn"]


class EngineConfig(BaseModel):
    """Settings of one replica's engine.

    Sizes are in tokens unless the name says otherwise. ``num_kv_blocks`` wins over
    ``kv_cache_memory_bytes``; with neither, the KV cache takes 1 GiB.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = Field(None, description="None: the embedded SmolLM2-135M-Instruct")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="weights, activations and KV cache; auto: bfloat16 on CUDA, float32 on CPU",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: CUDA when available, else the CPU"
    )
    block_size: int = Field(16, ge=1, description="tokens per KV block")
    num_kv_blocks: int | None = Field(
        None, ge=1, description="KV cache size in blocks; wins over kv_cache_memory_bytes"
    )
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="KV cache size in bytes; with neither size given, 1 GiB"
    )
    max_num_seqs: int = Field(64, ge=1, description="running requests per step at most")
    max_num_batched_tokens: int = Field(512, ge=1, description="token budget of one step")
    long_prefill_token_threshold: int | None = Field(
        None, ge=1, description="cap on one request's prefill chunk in a step"
    )
    enable_chunked_prefill: bool = Field(
        True,
        description="split a prompt over several steps' token budgets; false: a prompt is "
        "prefilled in one step",
    )
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV blocks of prompt prefixes computed before"
    )
    max_model_len: int | None = Field(None, ge=1, description="default: the model's context")
    policy: Literal["fcfs", "priority", "static"] = Field(
        "fcfs", description="the scheduling policy that orders the waiting queue"
    )
    aging_s_per_level: float | None = Field(
        10.0, gt=0, description="priority policy: seconds of waiting that gain one level"
    )
    max_head_of_line_skips: int = Field(
        8, ge=0, description="priority policy: admissions past a head that lacks KV room"
    )
    tpot_slo_guard: bool = Field(
        False,
        description="shed less urgent decodes and cap prefill chunks so the step "
        "time stays within the running requests' TPOT SLOs",
    )
    tpot_slo_guard_target: float = Field(
        0.85,
        gt=0,
        le=1,
        description="the TPOT guard aims the predicted step time at this "
        "fraction of the tightest TPOT SLO (headroom for "
        "step-time jitter)",
    )
    tpot_slo_guard_rules_off: list[GuardRule] = Field(
        default_factory=list,
        description="TPOT guard rules to switch off, for ablation "
        "studies (iterserve simulate --ablate)",
    )
    batch_wait_timeout_s: float = Field(
        0.5, ge=0, description="static policy: wait this long to fill a batch"
    )
    traffic_classes: dict[str, dict[str, Any]] | None = Field(
        None, description="overrides of policies.DEFAULT_CLASSES fields, by class name"
    )
    attention_backend: BackendChoice = Field(
        "auto",
        description="auto: flash_attn on CUDA where flash-attn imports and block_size is a "
        "multiple of 256, cpu_kernels in fp32 on the CPU where they build, else sdpa; a "
        "named backend that cannot run here is an error",
    )
    kv_cache_dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto",
        description="the KV cache's element type; auto: dtype. float16 and bfloat16 halve "
        "the bytes that decode attention reads (the CPU kernels convert in registers); "
        "flash_attn needs it equal to dtype",
    )
    quantization: Literal["auto", "none", "int8", "int4"] = Field(
        "auto",
        description="auto: a GGUF's quantized weights stay packed as stored (fp32 on the CPU, "
        "where the packed-weight kernels build; else de-quantized to dtype), a transformers "
        "directory loads as stored; none: de-quantize a GGUF to dtype; int8 / int4: quantize "
        "a transformers directory's linear layers weight-only at load (per-channel int8, or "
        "group-32 int4 with scale and minimum)",
    )
    cpu_weight_prepack: bool = Field(
        True,
        description="fp32 on CPU: run linear layers through oneDNN on weights "
        "prepacked once at load (engine.cpu.linear)",
    )
    seed: int = Field(
        0, description="seed of the sampling generator shared by requests without a `seed`"
    )
    max_loras: int = Field(
        4,
        ge=1,
        description="LoRA adapters in one step at most (their slots); a request whose adapter "
        "is not among the running requests' waits while they are all taken",
    )
    max_lora_rank: int = Field(
        16, ge=1, description="the largest LoRA rank an adapter may have (sizes the slots)"
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        description="LoRA adapters kept in host memory, the least recently used evicted "
        "(read again on their next use); None: max_loras",
    )
    embedding_pooling: Literal["last", "mean"] = Field(
        "last",
        description="how /v1/embeddings pools the prompt's final hidden states (after the "
        "model's last norm) into one vector, then L2-normalizes it: last, the last token's "
        "(Qwen3-Embedding's); mean, their mean over the prompt's tokens (such requests "
        "take no prefix-cache hits)",
    )
    embedding_dimensions: list[int] | None = Field(
        None,
        description="the sizes a Matryoshka-trained model's embeddings may be cut to "
        "(/v1/embeddings `dimensions`: the first components, then normalized); None: "
        "`dimensions` is refused unless it is the hidden size",
    )

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if not self.enable_chunked_prefill and self.long_prefill_token_threshold is not None:
            raise ValueError("long_prefill_token_threshold needs enable_chunked_prefill")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras {self.max_cpu_loras} is below max_loras {self.max_loras}"
            )
        if self.embedding_dimensions is not None and (
            not self.embedding_dimensions or min(self.embedding_dimensions) < 1
        ):
            raise ValueError(
                f"embedding_dimensions {self.embedding_dimensions}: a non-empty list of "
                "sizes >= 1 (or null)"
            )
        if self.attention_backend == "flash_attn" and self.block_size % FLASH_BLOCK_MULTIPLE:
            raise ValueError(
                f"attention_backend flash_attn needs block_size a multiple of "
                f"{FLASH_BLOCK_MULTIPLE}, not {self.block_size}"
            )
        return self

    def policy_spec(self) -> dict[str, Any]:
        """``{"name", "options"}`` of the scheduling policy (JSON: it travels to Serve's
        router and the ingress, which build it with ``policies.policy_from_spec``)."""
        return {"name": self.policy, "options": self._policy_options()}

    def make_policy(self) -> SchedulingPolicy:
        """The scheduling policy this config names, with its options."""
        return policy_from_spec(self.policy_spec())

    def _policy_options(self) -> dict[str, Any]:
        return {
            "fcfs": {},
            "priority": {
                "aging_s_per_level": self.aging_s_per_level,
                "max_head_of_line_skips": self.max_head_of_line_skips,
            },
            "static": {
                "max_num_seqs": self.max_num_seqs,
                "batch_wait_timeout_s": self.batch_wait_timeout_s,
            },
        }[self.policy]

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype: ``kv_cache_dtype``, or the model dtype for ``auto``."""
        if self.kv_cache_dtype == "auto":
            return self.torch_dtype()
        return getattr(torch, self.kv_cache_dtype)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            # bf16 matmuls are far slower than fp32 on CPUs without AVX512-BF16.
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)
