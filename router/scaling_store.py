"""Where the autoscaler's last decision lives: the Ray cluster's key-value store.

The controller's policy (:class:`deploy.autoscale.ServePolicy`) publishes each decision
(:class:`router.scaling.ScalingRecord`) here, and the Ray ingress
(:class:`router.api.OpenAIIngress`) reads it back; the two run in different processes and
this store is the one both reach. Kept apart from :mod:`router.scaling` because it imports
Ray (``ray.experimental.internal_kv``, a private API), which the in-process ingress must not.
"""

from __future__ import annotations

from router.scaling import ScalingRecord

KV_NAMESPACE = "iterserve"


def decision_key(app_name: str, deployment_name: str) -> str:
    """The store's key of a deployment's last decision."""
    return f"autoscale/{app_name}/{deployment_name}"


def publish_decision(app_name: str, deployment_name: str, record: ScalingRecord) -> None:
    """Store ``record`` as the deployment's last decision (a blocking call to Ray's GCS).

    Raises:
        RuntimeError: Ray is not initialized in this process.
    """
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        raise RuntimeError("Ray is not initialized in this process")
    internal_kv._internal_kv_put(
        decision_key(app_name, deployment_name), record.to_json(), namespace=KV_NAMESPACE
    )


def read_decision(app_name: str, deployment_name: str) -> ScalingRecord | None:
    """The deployment's last decision; None before the first (a blocking call to Ray's
    GCS: run it off the event loop).

    Raises:
        ValueError: the stored value is not a record.
    """
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        return None
    raw = internal_kv._internal_kv_get(
        decision_key(app_name, deployment_name), namespace=KV_NAMESPACE
    )
    return None if raw is None else ScalingRecord.from_json(raw)
