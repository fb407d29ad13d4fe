"""One replica's engine: request state, KV blocks, scheduler, model runner, sampler.

No Ray import here: the engine runs the same in a script, a test or a Serve replica.
"""

from engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from engine.config import EngineConfig
from engine.core.interfaces import ModelRunner, StepRecord
from engine.core.request import (
    CompletionOutput,
    ParamError,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.model.loader import ModelLoadError
from policies.limits import RequestRejectedError

__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "LLMEngine",
    "ModelLoadError",
    "ModelRunner",
    "ParamError",
    "RequestOutput",
    "RequestOutputKind",
    "RequestFailedError",
    "RequestRejectedError",
    "SamplingParams",
    "StepRecord",
]
