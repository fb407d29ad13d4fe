"""The ingress's settings: the fields :class:`deploy.config.ServiceConfig` shares with it,
defined once here (``ServiceConfig`` inherits them), plus what ``build_app`` derives."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from router.tenants import ApiKeyConfig
from router.tools import read_template

_KEYS = TypeAdapter(dict[str, ApiKeyConfig])


class IngressOptions(BaseModel):
    """The service settings the ingress reads as they are (no torch import)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    api_keys: dict[str, ApiKeyConfig] = Field(
        default_factory=dict,
        description="key -> tenant, class, priority ceiling; "
        "empty: no key needed, every request `standard`",
    )
    api_keys_file: str | None = Field(
        None,
        description="a YAML file of more api_keys in the same form, read where the "
        "ingress runs (a mounted Kubernetes Secret), so that keys never "
        "travel in the config",
    )
    admission: bool = Field(True, description="SLO-aware admission at the ingress")
    max_n: int = Field(8, ge=1, description="cap on a request's choices: `n` times its prompts")
    max_embedding_inputs: int = Field(
        2048, ge=1, description="cap on the inputs of one /v1/embeddings request (OpenAI's)"
    )
    max_request_body_bytes: int = Field(1 << 20, ge=1024, description="larger bodies get 413")
    allowed_origins: list[str] = Field(
        default_factory=lambda: ["*"],
        description="origins browsers may call the API from (CORS); ['*']: any",
    )
    max_queue_time_s: float = Field(
        30.0,
        gt=0,
        description="seconds a request may wait, from its arrival to its first token, "
        "before it is refused (429, or an error event in an open stream); a class whose "
        "TTFT SLO is longer waits up to that SLO instead, and a class that is not "
        "`rejectable` (batch) waits its turn",
    )
    lora_adapters: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters served from the start: name -> PEFT directory, which every "
        "replica must be able to read; a request names one as its `model`",
    )
    allow_runtime_lora_updates: bool = Field(
        False,
        description="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING); where api_keys are set, only an `admin` key may "
        "call them. Off: they answer 404",
    )
    chat_template: str | None = Field(
        None,
        description="the chat template of every chat request: a Jinja file's path or the "
        "template itself (read once, at start); null: the model's own, and where it does not "
        "take tools, iterserve's Hermes-format template for requests with tools",
    )
    tool_call_parser: Literal["hermes", "llama3_json"] = Field(
        "hermes",
        description="how the model writes tool calls, for their grammar and their parser: "
        '`hermes` (<tool_call>{"name", "arguments"}</tool_call>: Hermes, Qwen2.5, Qwen3, and '
        'the shipped template) or `llama3_json` ({"name", "parameters"}: Llama 3.1-3.3 with '
        "their own template)",
    )
    stream_keepalive_s: float = Field(
        15.0,
        gt=0,
        description="seconds of silence after which a stream sends an SSE comment "
        "(`: keepalive`), so that a proxy's idle timeout does not cut a waiting request",
    )

    @field_validator("chat_template")
    @classmethod
    def _template_text(cls, v: str | None) -> str | None:
        # Read where the config is loaded, so that the text travels to every ingress.
        return None if v is None else read_template(v)

    def all_api_keys(self) -> dict[str, ApiKeyConfig]:
        """``api_keys`` together with those in ``api_keys_file``.

        Raises:
            ValueError: the file cannot be read, is not a mapping of key -> ApiKeyConfig
                fields, or repeats a key of ``api_keys``.
        """
        if self.api_keys_file is None:
            return dict(self.api_keys)
        path = Path(self.api_keys_file)
        try:
            loaded = _KEYS.validate_python(yaml.safe_load(path.read_text()) or {})
        except (OSError, yaml.YAMLError, ValueError) as e:
            raise ValueError(f"api_keys_file {path}: {e}") from e
        repeated = sorted(set(loaded) & set(self.api_keys))
        if repeated:
            raise ValueError(f"api_keys_file {path}: {len(repeated)} keys also in api_keys")
        return {**self.api_keys, **loaded}


class IngressSettings(IngressOptions):
    """:class:`IngressOptions` plus what ``deploy.app.build_app`` derives from the service
    config, in the JSON form that travels to the ingress replica."""

    model_name: str
    traffic_classes: dict[str, dict[str, Any]] | None = None
    """Every class's fields, as ``ServiceConfig.traffic_classes`` resolved them; None:
    the defaults."""
    policy: dict[str, Any] | None = None
    """The replicas' ``EngineConfig.policy_spec``; None: the priority policy."""
    num_replicas: int = 1
    """Model replicas the application asks for (``iterserve:num_replicas_target``); with
    ``autoscaling``, the count it starts with."""
    autoscaling: dict[str, Any] | None = None
    """The autoscaler's settings (:class:`policies.autoscale.AutoscalingSettings` fields)
    when it scales the replicas: the ingress then counts each class's traffic for it
    (:class:`router.scaling.ScalingSignals`); None: a fixed fleet."""
    prefix_block_size: int | None = None
    """The replicas' KV block size when requests carry prefix hashes for prefix-affinity
    routing (prefix caching and ``prefix_affinity`` on); None: they carry none."""
