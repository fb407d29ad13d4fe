"""The autoscaler's inputs as flat ``{name: float}`` maps: the form they travel in.

Live, :class:`policies.autoscale.SloAutoscaler` runs in Ray Serve's controller, which
reads nothing but the numbers each model replica returns from
``record_autoscaling_stats`` (a ``dict[str, float]``). So the ingress encodes its
per-class window (:func:`encode_classes`) and sends it to every replica; each replica
returns it with its own load (:func:`encode_replica`), and the controller's policy
(:class:`deploy.autoscale.ServePolicy`) decodes both (:func:`decode_classes`,
:func:`decode_replica`). Pure Python.

Keys: ``ingress_at`` (when the ingress took the counts, Unix seconds: the clocks of
other processes compare with it), ``ingress_window_s`` (the seconds the counts cover),
``class:NAME:FIELD`` for each :class:`policies.autoscale.ClassLoad` field of each class,
and ``replica:FIELD`` for the replica's own :class:`policies.autoscale.ReplicaLoad` (a
flag as 0 or 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from policies.autoscale import ClassLoad, ReplicaLoad
from policies.load import LoadSnapshot

SIGNALS_AT = "ingress_at"
SIGNALS_WINDOW = "ingress_window_s"
CLASS_PREFIX = "class:"
REPLICA_PREFIX = "replica:"

_CLASS_FIELDS = tuple(f.name for f in dataclasses.fields(ClassLoad))
_INT_CLASS_FIELDS = frozenset(
    f.name for f in dataclasses.fields(ClassLoad) if f.type in ("int", int)
)
_COEFFICIENTS = ("step_a", "step_b", "step_c")
_REPLICA_FIELDS = (
    "running",
    "waiting",
    "kv_usage",
    "step_s",
    "waiting_prefill_tokens",
    "step_fit_warm",
)


@dataclass(frozen=True, slots=True)
class IngressSignals:
    """The ingress's per-class counts as the controller receives them."""

    at: float
    """When the ingress took them, Unix seconds."""
    window_s: float
    """Seconds they cover (:meth:`policies.scaling_window.ClassWindow.span_s`)."""
    classes: dict[str, ClassLoad]


def encode_classes(loads: Mapping[str, ClassLoad], window_s: float, at: float) -> dict[str, float]:
    """``loads`` (per class), the seconds they cover and when they were taken, flat."""
    out = {SIGNALS_AT: float(at), SIGNALS_WINDOW: float(window_s)}
    for name, load in loads.items():
        for f in _CLASS_FIELDS:
            out[f"{CLASS_PREFIX}{name}:{f}"] = float(getattr(load, f))
    return out


def decode_classes(values: Mapping[str, float]) -> IngressSignals | None:
    """The inverse of :func:`encode_classes`; None when ``values`` holds no ingress signals.
    Other keys (a replica's own) are ignored, and so is a class with a field missing."""
    if SIGNALS_AT not in values or SIGNALS_WINDOW not in values:
        return None
    fields: dict[str, dict[str, float]] = {}
    for key, value in values.items():
        if not key.startswith(CLASS_PREFIX):
            continue
        name, _, f = key[len(CLASS_PREFIX) :].rpartition(":")
        if name and f in _CLASS_FIELDS:
            fields.setdefault(name, {})[f] = value
    classes = {
        name: ClassLoad(**{f: int(v) if f in _INT_CLASS_FIELDS else v for f, v in got.items()})
        for name, got in sorted(fields.items())
        if len(got) == len(_CLASS_FIELDS)
    }
    return IngressSignals(values[SIGNALS_AT], values[SIGNALS_WINDOW], classes)


def replica_load(snap: LoadSnapshot) -> ReplicaLoad:
    """What the autoscaler reads of one replica's load snapshot."""
    return ReplicaLoad(
        running=snap.total_running,
        waiting=sum(snap.waiting_requests.values()),
        kv_usage=snap.kv_usage,
        step_s=snap.recent_step_s,
        waiting_prefill_tokens=sum(snap.waiting_prefill_tokens.values()),
        step_coefficients=snap.step_coefficients,
        step_fit_warm=snap.step_fit_warm,
    )


def encode_replica(load: ReplicaLoad) -> dict[str, float]:
    """One replica's load, flat."""
    out = {f"{REPLICA_PREFIX}{f}": float(getattr(load, f)) for f in _REPLICA_FIELDS}
    for key, c in zip(_COEFFICIENTS, load.step_coefficients):
        out[f"{REPLICA_PREFIX}{key}"] = float(c)
    return out


def decode_replica(values: Mapping[str, float]) -> ReplicaLoad | None:
    """The inverse of :func:`encode_replica`; None when a key is missing."""
    keys = [f"{REPLICA_PREFIX}{f}" for f in (*_REPLICA_FIELDS, *_COEFFICIENTS)]
    if any(k not in values for k in keys):
        return None
    get = {f: values[f"{REPLICA_PREFIX}{f}"] for f in (*_REPLICA_FIELDS, *_COEFFICIENTS)}
    return ReplicaLoad(
        running=int(get["running"]),
        waiting=int(get["waiting"]),
        kv_usage=get["kv_usage"],
        step_s=get["step_s"],
        waiting_prefill_tokens=int(get["waiting_prefill_tokens"]),
        step_coefficients=(get["step_a"], get["step_b"], get["step_c"]),
        step_fit_warm=get["step_fit_warm"] > 0,
    )


__all__ = [
    "CLASS_PREFIX",
    "REPLICA_PREFIX",
    "SIGNALS_AT",
    "SIGNALS_WINDOW",
    "IngressSignals",
    "decode_classes",
    "decode_replica",
    "encode_classes",
    "encode_replica",
    "replica_load",
]
