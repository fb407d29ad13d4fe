"""The Helm chart's ``values.schema.json``, generated from :class:`deploy.config.ServiceConfig`.

The chart's ``config:`` value is the service's own config, the YAML that ``iterserve serve
--config`` reads, so its schema is ServiceConfig's JSON schema with these changes for
Kubernetes:

- ``api_keys`` and ``api_keys_file`` are left out: keys come from the Secret named by
  ``apiKeysSecret``, which the chart mounts and points ``api_keys_file`` at;
- ``replica_num_cpus`` must be a number (a pod's CPU request), not None;
- ``engine.traffic_classes`` names :class:`policies.TrafficClass`'s fields, so an unknown
  field fails at render time, not when the replica starts;
- GPUs with ``engine.device: cpu`` or the CPU dtype ``float32`` are refused, as
  ServiceConfig refuses them;
- ``num_replicas`` also takes ``auto`` (ServiceConfig's shorthand for an ``autoscaling``
  section), and a number of replicas beside an ``autoscaling`` section is refused, as
  ServiceConfig refuses it.

Two of AutoscalingConfig's rules compare one field with another (``max_replicas >=
min_replicas``, ``window_s >= decision_period_s``), which JSON Schema cannot say; the
chart's template checks them (``iterserve.autoscaling`` in ``templates/_helpers.tpl``),
with the chart's own rule that ``max_replicas`` be set.

The other values (``image``, ``head``, ``worker``, ``autoscaler``, ``service``, ...) are the
chart's own.

Run ``python -m deploy.chart_schema`` after changing ServiceConfig; a test checks that
the committed file equals the generated one.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from deploy.config import ServiceConfig
from policies import TrafficClass

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "helm/iterserve/values.schema.json"
CHART_ONLY = ("api_keys", "api_keys_file")

_STR = {"type": "string"}
_MAP = {"type": "object", "additionalProperties": _STR}
_OBJ = {"type": "object"}


def _obj(**props: Any) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "properties": props}


CHART_VALUES: dict[str, Any] = {
    "nameOverride": _STR,
    "fullnameOverride": _STR,
    "image": _obj(
        repository={"type": "string", "minLength": 1},
        tag=_STR,
        pullPolicy={"enum": ["Always", "IfNotPresent", "Never"]},
    ),
    "imagePullSecrets": {"type": "array", "items": _OBJ},
    "rayVersion": {"type": "string", "minLength": 1},
    "rayAuthToken": {"type": "boolean", "description": "KubeRay's token authentication"},
    "apiKeysSecret": {"type": "string", "description": "a Secret with the key api_keys.yaml"},
    "modelVolume": _obj(
        claimName=_STR, hostPath=_STR, mountPath={"type": "string", "pattern": "^/"}
    ),
    "adapterVolume": _obj(
        claimName=_STR, hostPath=_STR, mountPath={"type": "string", "pattern": "^/"}
    ),
    "head": _obj(
        cpu={"type": ["string", "number"]},
        memory=_STR,
        nodeSelector=_MAP,
        tolerations={"type": "array", "items": _OBJ},
    ),
    "worker": _obj(memory=_STR, nodeSelector=_MAP, tolerations={"type": "array", "items": _OBJ}),
    "autoscaler": _obj(
        upscalingMode={"enum": ["Default", "Aggressive", "Conservative"]},
        idleTimeoutSeconds={"type": "integer", "minimum": 0},
        cpu={"type": ["string", "number"]},
        memory=_STR,
    ),
    "service": _obj(
        type={"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
        port={"type": "integer", "minimum": 1, "maximum": 65535},
        annotations=_MAP,
    ),
    "ingress": _obj(
        enabled={"type": "boolean"},
        className=_STR,
        host=_STR,
        annotations=_MAP,
        tls={"type": "array", "items": _OBJ},
    ),
    "podMonitor": _obj(enabled={"type": "boolean"}, interval=_STR, labels=_MAP),
    "grafanaDashboard": _obj(enabled={"type": "boolean"}, labels=_MAP),
    "batchJob": _obj(
        enabled={"type": "boolean"},
        input=_STR,
        output=_STR,
        claimName=_STR,
        mountPath={"type": "string", "pattern": "^/"},
        args={"type": "array", "items": _STR},
        ttlSecondsAfterFinished={"type": "integer", "minimum": 0},
    ),
}

GPU_RULE = {
    "if": {
        "required": ["config"],
        "properties": {
            "config": {
                "required": ["replica_num_gpus"],
                "properties": {"replica_num_gpus": {"exclusiveMinimum": 0}},
            }
        },
    },
    "then": {
        "properties": {
            "config": {
                "properties": {
                    "engine": {
                        "properties": {
                            "dtype": {
                                "enum": ["auto", "bfloat16", "float16"],
                                "description": "with GPUs: float32 is the CPU dtype",
                            },
                            "device": {"enum": ["auto", "cuda"]},
                        }
                    }
                }
            }
        }
    },
}


AUTOSCALING_RULE = {
    "if": {
        "required": ["config"],
        "properties": {
            "config": {
                "required": ["autoscaling"],
                "properties": {"autoscaling": {"type": "object"}},
            }
        },
    },
    "then": {
        "properties": {
            "config": {
                "properties": {
                    "num_replicas": {
                        "const": "auto",
                        "description": "with an autoscaling section: auto or unset "
                        "(min_replicas and max_replicas bound the count)",
                    }
                }
            }
        }
    },
}


def num_replicas_schema(field: dict[str, Any]) -> dict[str, Any]:
    """``num_replicas``: ServiceConfig's integer, or ``auto``. One ``type`` list, not an
    ``anyOf``, so that a number out of range is reported as such (``minimum`` applies to
    numbers only, ``pattern`` to strings only)."""
    return {**field, "type": ["integer", "string"], "pattern": "^auto$"}


def traffic_class_override() -> dict[str, Any]:
    """Schema of one class's overrides: any of TrafficClass's fields but ``name``."""
    schema = TypeAdapter(TrafficClass).json_schema()
    props = {k: v for k, v in schema["properties"].items() if k != "name"}
    return {"type": "object", "additionalProperties": False, "properties": props}


def values_schema() -> dict[str, Any]:
    """The chart's whole values schema (JSON Schema 2020-12)."""
    config = copy.deepcopy(ServiceConfig.model_json_schema())
    defs = config.pop("$defs")
    for name in CHART_ONLY:
        config["properties"].pop(name)
    config["properties"]["replica_num_cpus"] = {
        **config["properties"]["replica_num_cpus"]["anyOf"][0],
        "description": "CPUs per replica: its worker pod's CPU request and Ray's num-cpus",
    }
    config["properties"]["num_replicas"] = num_replicas_schema(config["properties"]["num_replicas"])
    config["required"] = ["replica_num_cpus"]
    engine = defs["EngineConfig"]["properties"]
    engine.pop("model")
    engine["traffic_classes"]["anyOf"][0]["additionalProperties"] = {
        "$ref": "#/$defs/TrafficClassOverride"
    }
    defs["TrafficClassOverride"] = traffic_class_override()
    defs["ServiceConfig"] = config
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "iterserve Helm values",
        "type": "object",
        "additionalProperties": False,
        "required": ["config", "image"],
        "properties": {"config": {"$ref": "#/$defs/ServiceConfig"}, **CHART_VALUES},
        "allOf": [GPU_RULE, AUTOSCALING_RULE],
        "$defs": defs,
    }


def render() -> str:
    """:func:`values_schema` as the committed file's text (sorted keys, 2-space indent)."""
    return json.dumps(values_schema(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    SCHEMA_PATH.write_text(render())
    print(f"wrote {SCHEMA_PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
