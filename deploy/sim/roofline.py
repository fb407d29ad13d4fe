"""The roofline step-cost model, for GPUs the project cannot measure.

Each step takes the longer of its FLOPs at the GPU's peak and its bytes at the GPU's memory
bandwidth, each derated by an efficiency factor per phase (:mod:`deploy.sim.hardware` holds
the figures). A pure function of the step's shape (:class:`engine.core.step_cost.StepShape`), as
:class:`engine.core.step_cost.LinearCost` is.
"""

from __future__ import annotations

from dataclasses import dataclass

from deploy.sim.hardware import GPUS, MODELS, GpuSpec, ModelSpec
from engine.core.step_cost import StepShape, check_lora_terms, lora_seconds


@dataclass(frozen=True, slots=True)
class RooflineCost:
    """A step on a GPU: ``max(FLOPs / (peak x eff), bytes / (bandwidth x eff)) + overhead``.

    FLOPs: ``2 x (non-embedding parameters) x tokens`` for the matmuls, ``2 x vocabulary x
    hidden`` per sampled sequence for the LM head, and ``4 x layers x heads x head_dim``
    per attended query-key pair (QK^T and PV). Bytes: the weights once
    per step, plus the KV cache each decode reads, plus the KV each token writes. The
    efficiencies are per phase: a step with prefill tokens uses ``prefill_efficiency``
    (compute-bound GEMMs reach a fraction of peak), a decode-only step uses
    ``decode_efficiency`` (bandwidth-bound). ``step_overhead_s`` is the host's time per step
    (scheduling, launches, sampling) that the GPU does not overlap; 4 ms is an assumption
    in the range vLLM's V1 scheduler was reworked to reach (its 2025 blog), not a measure.
    ``lora_token_s``, ``lora_adapter_s`` and ``lora_step_s`` price a step's LoRA adapters on top
    (:func:`engine.core.step_cost.lora_seconds`; 0 by default: no measurement yet).

    Raises:
        ValueError: a LoRA term that is negative or not finite.
    """

    model: ModelSpec
    gpu: GpuSpec
    prefill_efficiency: float = 0.6
    decode_efficiency: float = 0.7
    step_overhead_s: float = 0.004
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    tensor_parallel: int = 1
    """GPUs per replica: each computes and reads ``1 / tensor_parallel`` of the step, and
    their memory adds up (the all-reduces between them are not modelled)."""
    lora_token_s: float = 0.0
    """Seconds per step row (token) per distinct LoRA adapter in the step."""
    lora_step_s: float = 0.0
    """Seconds a step with any LoRA adapter adds."""
    lora_adapter_s: float = 0.0
    """Seconds per distinct LoRA adapter in the step (reading its matrices)."""

    def __post_init__(self) -> None:
        check_lora_terms(self.lora_token_s, self.lora_step_s, self.lora_adapter_s)

    @classmethod
    def named(cls, model: str, gpu: str, **kw) -> RooflineCost:
        """By names in :data:`deploy.sim.hardware.MODELS` and ``GPUS``.

        Raises:
            ValueError: an unknown name.
        """
        if model not in MODELS or gpu not in GPUS:
            raise ValueError(
                f"unknown model {model!r} or GPU {gpu!r}; models: "
                f"{sorted(MODELS)}, GPUs: {sorted(GPUS)}"
            )
        return cls(MODELS[model], GPUS[gpu], **kw)

    @property
    def num_kv_blocks(self) -> int:
        """Blocks that fit in the GPU's memory after the weights (vLLM's
        ``gpu_memory_utilization`` rule, activations ignored)."""
        memory = self.gpu.memory_bytes * self.tensor_parallel
        free = memory * self.gpu_memory_utilization - self.model.weight_bytes
        per_block = self.model.kv_bytes_per_token * self.block_size
        return max(0, int(free // per_block))

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def step_seconds(self, shape: StepShape) -> float:
        m = self.model
        tokens = shape.prefill_tokens + shape.decode_seqs
        pairs = shape.prefill_attention_pairs + shape.decode_context_tokens
        sampled = shape.decode_seqs + shape.prefill_seqs  # logits only where a chunk ends
        flops = (
            2 * m.matmul_params * tokens
            + 2 * m.vocab_size * m.hidden * sampled
            + 4 * m.layers * m.heads * m.head_dim * pairs
        )
        kv_read = shape.decode_context_tokens * m.kv_bytes_per_token
        nbytes = m.weight_bytes + kv_read + tokens * m.kv_bytes_per_token
        eff = self.prefill_efficiency if shape.prefill_tokens else self.decode_efficiency
        compute = flops / (self.gpu.peak_flops * eff * self.tensor_parallel)
        memory = nbytes / (self.gpu.bandwidth_bytes_s * eff * self.tensor_parallel)
        adapters = lora_seconds(shape, self.lora_token_s, self.lora_step_s, self.lora_adapter_s)
        return max(compute, memory) + self.step_overhead_s + adapters
