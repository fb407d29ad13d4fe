"""One replica's engine: request state, KV blocks, scheduler, model runner, sampler.

No Ray import here: the engine runs the same in a script, a test or a Serve replica.

The public names resolve on first use (PEP 562), so that importing a torch-free module
under ``engine`` (:mod:`engine.core.params`, which the router imports) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
    from engine.config import EngineConfig
    from engine.core.interfaces import ModelRunner, StepRecord
    from engine.core.params import ParamError, PoolingParams, RequestOutputKind, SamplingParams
    from engine.core.request import CompletionOutput, RequestOutput
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.model.loader import ModelLoadError
    from policies.limits import RequestRejectedError

_HOMES = {
    "LLM": "engine.llm",
    "AsyncLLMEngine": "engine.async_engine",
    "CompletionOutput": "engine.core.request",
    "EngineConfig": "engine.config",
    "EngineDeadError": "engine.async_engine",
    "LLMEngine": "engine.llm_engine",
    "LoRARequest": "engine.core.params",
    "ModelLoadError": "engine.model.loader",
    "ModelRunner": "engine.core.interfaces",
    "ParamError": "engine.core.params",
    "PoolingParams": "engine.core.params",
    "RequestOutput": "engine.core.request",
    "RequestOutputKind": "engine.core.params",
    "RequestFailedError": "engine.async_engine",
    "RequestRejectedError": "policies.limits",
    "SamplingParams": "engine.core.params",
    "StepRecord": "engine.core.interfaces",
}
"""Each public name's module."""

__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "LLMEngine",
    "LoRARequest",
    "ModelLoadError",
    "ModelRunner",
    "ParamError",
    "PoolingParams",
    "RequestOutput",
    "RequestOutputKind",
    "RequestFailedError",
    "RequestRejectedError",
    "SamplingParams",
    "StepRecord",
]


def __getattr__(name: str) -> object:
    """A public name, imported from its module on first use and kept here after.

    Raises:
        AttributeError: ``name`` is not one of :data:`__all__`.
    """
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
