"""LoRA adapters per request: loading PEFT directories (:mod:`engine.lora.adapter`),
applying many in one step (:mod:`engine.lora.layers`), and one replica's set of them
(:mod:`engine.lora.manager`)."""

from engine.lora.adapter import AdapterError, LoRAAdapter, load_adapter
from engine.lora.manager import LoRAManager

__all__ = ["AdapterError", "LoRAAdapter", "LoRAManager", "load_adapter"]
