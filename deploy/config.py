"""ServiceConfig: one model for the YAML file, the CLI flags and the Helm values.

A setting has one name everywhere: ``num_replicas`` in YAML is ``--num-replicas`` on the
command line. Engine settings nest under ``engine`` (:class:`engine.EngineConfig` fields,
``model`` excepted: it is top level because the API serves it by name).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml
from pydantic import ConfigDict, Field, field_validator, model_validator

from engine.config import EngineConfig
from engine.core.step_cost import LinearCost
from engine.core.step_log import HISTORY
from policies import TrafficClass, make_classes
from policies.autoscale import AutoscalingSettings
from router.settings import IngressOptions, IngressSettings
from router.tenants import check_key_classes

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SERVER_ENGINE_DEFAULTS: dict[str, Any] = {"policy": "priority", "tpot_slo_guard": True}
"""The server's engine settings where they differ from :class:`engine.EngineConfig`'s; an
``engine:`` section in the YAML changes only the keys it names."""


def host_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers narrow)."""
    return len(os.sched_getaffinity(0))


def _read_cost(path: str) -> LinearCost:
    """``path`` as a :class:`engine.core.step_cost.LinearCost`, with errors that say what it
    should be.

    Raises:
        ValueError: it cannot be read, is not JSON, or is not a calibration file.
    """
    hint = "expected a cost model file from `iterserve calibrate`"
    try:
        return LinearCost.load(path)
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror or e}): {hint}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e}): {hint}") from None
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: malformed ({type(e).__name__}: {e}): {hint}") from None


class AutoscalingConfig(AutoscalingSettings):
    """The ``autoscaling:`` section: bounds and the settings of the SLO autoscaler
    (:mod:`policies.autoscale`). Each name is the same in the YAML, the Helm values'
    ``config.autoscaling`` and :class:`policies.autoscale.AutoscalingSettings`, which
    declares them; only ``max_replicas`` differs here, as it may be left to the host.

    Raises (at construction):
        pydantic.ValidationError: an unknown key or a value out of range.
    """

    max_replicas: int | None = Field(
        None,
        ge=1,
        description="replicas at most; None: this host's CPUs divided by replica_num_cpus",
    )

    def settings(self, replica_num_cpus: float) -> AutoscalingSettings:
        """The policy's settings, ``max_replicas`` resolved against this host."""
        fields = self.model_dump()
        if fields["max_replicas"] is None:
            fields["max_replicas"] = max(
                self.min_replicas, int(host_cpus() // max(replica_num_cpus, 1e-9))
            )
        return AutoscalingSettings(**fields)


class ServiceConfig(IngressOptions):
    """Everything ``iterserve serve`` and ``build_app`` need (the ingress's own fields,
    ``api_keys``, ``admission``, ``max_n``, ``max_request_body_bytes``,
    ``allowed_origins``, ``max_queue_time_s`` and ``stream_keepalive_s``, are inherited
    from :class:`router.settings.IngressOptions`).

    Raises (at construction):
        pydantic.ValidationError: an unknown key or a value out of range.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = Field(None, description="None: the embedded SmolLM2-135M-Instruct")
    served_model_name: str | None = Field(
        None, description="the name clients send as `model`; default: the model's name"
    )
    num_replicas: int = Field(
        1,
        ge=1,
        description="model replicas; more than one serves on Ray Serve. `auto`: scale "
        "between the `autoscaling` section's bounds (its defaults if there is none)",
    )
    autoscaling: AutoscalingConfig | None = Field(
        None,
        description="scale the replicas on the traffic classes' SLOs (policies/autoscale.py) "
        "on Ray Serve; num_replicas is then the start count, min_replicas. None: a fixed "
        "num_replicas",
    )
    replica_num_cpus: float | None = Field(
        None,
        gt=0,
        description="CPUs Ray reserves per replica; torch uses as many threads. "
        "None: this host's CPUs divided among the replicas",
    )
    replica_num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (0: CPU)")
    max_ongoing_requests: int = Field(
        512, ge=1, description="requests in flight per replica (Ray Serve's cap)"
    )
    engine: EngineConfig = Field(
        default_factory=lambda: EngineConfig(**SERVER_ENGINE_DEFAULTS),
        description="engine.EngineConfig fields except `model` (set at the top level); "
        "a partial section is merged over SERVER_ENGINE_DEFAULTS",
    )
    routing_stats_period_s: float = Field(
        0.25, gt=0, description="how often each replica publishes its load snapshot"
    )
    replica_stall_timeout_s: float = Field(
        30.0,
        gt=0,
        description="seconds a replica's engine may hold unfinished requests without "
        "finishing a step before its health check fails: its requests then move to "
        "another replica and Ray Serve replaces it. Far above the longest step (a long "
        "prefill chunk on a few loaded cores takes seconds), so only a stuck engine trips it",
    )
    health_check_period_s: float = Field(
        2.0, gt=0, description="seconds between Ray Serve's health checks of each replica"
    )
    health_check_timeout_s: float = Field(
        10.0,
        gt=0,
        description="seconds a replica has to answer a health check; Serve replaces a "
        "replica after three failed checks in a row, so a stopped process (SIGSTOP, a "
        "hung host) is taken out after about three times this. A replica answers in "
        "milliseconds unless its process cannot run",
    )
    prefix_affinity: bool = Field(
        True,
        description="between two replicas with room for the request's TPOT SLO whose "
        "predicted TTFTs are within a step of each other, route to the one that was sent "
        "a longer prefix of the prompt (needs engine.enable_prefix_caching)",
    )
    step_log: str | None = Field(
        None,
        description="a JSONL file the server appends every engine step and every request's "
        "arrival, admission, refusal and finish to (`iterserve simulate --replay-steps` "
        "reads it; format: engine/core/step_log.py); one-process server (num_replicas: 1) only",
    )
    step_history: int = Field(
        HISTORY,
        ge=0,
        description="step-log records (steps and request events) kept in memory for "
        "`GET /steps`, which `iterserve calibrate --from-url` and `iterserve simulate "
        "--from-url` read; 0: none kept",
    )
    twin_cost_model: str | None = Field(
        None,
        description="the simulator's step-time model that each replica checks its measured "
        "step times against (`iterserve:step_time_prediction_ratio`): a file written by "
        "`iterserve calibrate` or `iterserve calibrate --from-url`, read where the config "
        "is loaded (its contents travel to the replicas); None: each replica fits its own "
        "on its first steps, so the ratio tells how far it drifted since",
    )
    host: str = Field("127.0.0.1", description="the address the HTTP server binds")
    port: int = Field(8000, ge=0, le=65535, description="the HTTP port of the API")

    @model_validator(mode="before")
    @classmethod
    def _auto_replicas(cls, data: Any) -> Any:
        # `num_replicas: auto` is shorthand for an autoscaling section; with a section, the
        # count starts at its min_replicas, so a fixed count beside one is a contradiction.
        if not isinstance(data, dict):
            return data
        data = dict(data)
        n = data.get("num_replicas")
        if n == "auto":
            data["autoscaling"] = data.get("autoscaling") or {}
            del data["num_replicas"]
        if data.get("autoscaling") is not None:
            section = data["autoscaling"]
            start = (
                section.min_replicas
                if isinstance(section, AutoscalingConfig)
                else (section.get("min_replicas", 1))
            )
            # The start count itself is what a dumped config holds: it reads back.
            if n not in (None, "auto", start):
                raise ValueError(
                    f"num_replicas: {n} with an autoscaling section: set num_replicas: auto "
                    "(autoscaling.min_replicas and max_replicas bound the count)"
                )
            data["num_replicas"] = start
            # One CPU per replica unless set: the host's CPUs are shared out as replicas
            # come, not all given to the first.
            data.setdefault("replica_num_cpus", 1.0)
        return data

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_merged(cls, v: Any) -> Any:
        # A partial section (one class's SLOs, say) must not drop the server's policy
        # and TPOT guard.
        if not isinstance(v, dict):
            return v
        if "model" in v:
            raise ValueError("set `model` at the top level, not under `engine`")
        return {**SERVER_ENGINE_DEFAULTS, **v}

    @field_validator("twin_cost_model")
    @classmethod
    def _twin_cost_readable(cls, v: str | None) -> str | None:
        # Read now, so a bad file stops `iterserve serve` before the model loads.
        if v is not None:
            _read_cost(v)
        return v

    @model_validator(mode="after")
    def _cpus_resolved(self) -> ServiceConfig:
        # Every core to the replicas: a replica held to fewer CPUs than the host has leaves
        # the rest idle and costs more per token (bench.peers' iterserve-before system).
        # Several replicas sharing a few cores were not measured side by side.
        if self.replica_num_cpus is None:
            self.replica_num_cpus = float(max(1, host_cpus() // self.num_replicas))
        return self

    @model_validator(mode="after")
    def _gpu_consistent(self) -> ServiceConfig:
        # The same rule as helm/iterserve/values.schema.json's, so the chart and the CLI
        # refuse the same configs.
        if self.replica_num_gpus > 0 and self.engine.device == "cpu":
            raise ValueError("replica_num_gpus > 0 with engine.device 'cpu'; use 'auto'")
        if self.replica_num_gpus > 0 and self.engine.dtype == "float32":
            raise ValueError(
                "replica_num_gpus > 0 with engine.dtype 'float32', the CPU dtype: "
                "flash-attn needs bfloat16 or float16 ('auto' picks bfloat16)"
            )
        return self

    @model_validator(mode="after")
    def _step_log_local(self) -> ServiceConfig:
        # Replicas on Ray Serve keep no step log yet: refused, not silently ignored.
        if self.step_log is not None and (self.num_replicas > 1 or self.autoscaling):
            raise ValueError(
                "step_log is recorded by the one-process server; it needs num_replicas: 1"
            )
        return self

    @model_validator(mode="after")
    def _keys_valid(self) -> ServiceConfig:
        # Keys in api_keys_file are checked where the file is read (the ingress).
        check_key_classes(self.api_keys, self.traffic_classes())
        return self

    def engine_config(self) -> EngineConfig:
        """The replicas' :class:`engine.EngineConfig`: ``engine`` with the top-level model."""
        return self.engine.model_copy(update={"model": self.model})

    def traffic_classes(self) -> dict[str, TrafficClass]:
        """Traffic classes by name: the defaults with ``engine.traffic_classes`` applied."""
        return make_classes(self.engine.traffic_classes)

    def ingress_settings(self) -> IngressSettings:
        """The ingress's settings: its own fields and what it derives from the rest."""
        engine = self.engine_config()
        classes = {name: asdict(c) for name, c in self.traffic_classes().items()}
        return IngressSettings(
            **self.model_dump(include=set(IngressOptions.model_fields)),
            model_name=self.model_name(),
            traffic_classes=classes,
            policy=engine.policy_spec(),
            num_replicas=self.num_replicas,
            autoscaling=scaling.model_dump() if (scaling := self.autoscaling_settings()) else None,
            prefix_block_size=(
                engine.block_size if self.prefix_affinity and engine.enable_prefix_caching else None
            ),
        )

    def autoscaling_settings(self) -> AutoscalingSettings | None:
        """The autoscaler's settings (None: a fixed fleet)."""
        if self.autoscaling is None:
            return None
        return self.autoscaling.settings(self.replica_num_cpus or 1.0)

    def twin_cost(self) -> LinearCost | None:
        """The model ``twin_cost_model`` names (None: none named).

        Raises:
            ValueError: the file cannot be read or is not a calibration file.
        """
        return None if self.twin_cost_model is None else _read_cost(self.twin_cost_model)

    def model_name(self) -> str:
        """The name the API serves the model under."""
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return DEFAULT_MODEL_NAME
        return Path(self.model.rstrip("/")).name.removesuffix(".gguf")

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        engine: dict[str, Any] | None = None,
        **overrides: Any,
    ) -> ServiceConfig:
        """Read a YAML file (optional), then apply non-None ``overrides`` (CLI flags) and the
        non-None keys of ``engine`` over the file's ``engine:`` section.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ValueError: the file is not YAML, or not a YAML mapping.
            pydantic.ValidationError: a bad key or value.
        """
        data: dict[str, Any] = {}
        if path is not None:
            try:
                loaded = yaml.safe_load(Path(path).read_text())
            except yaml.YAMLError as e:
                raise ValueError(f"{path}: not valid YAML ({e})".replace("\n", " ")) from None
            if loaded is not None and not isinstance(loaded, dict):
                raise ValueError(f"{path}: expected a YAML mapping at the top level")
            data = dict(loaded or {})
        data.update({k: v for k, v in overrides.items() if v is not None})
        engine_flags = {k: v for k, v in (engine or {}).items() if v is not None}
        if engine_flags:
            section = data.get("engine") or {}
            if not isinstance(section, dict):
                raise ValueError("engine: expected a mapping")
            data["engine"] = {**section, **engine_flags}
        return cls(**data)
