"""Replica choice: power of two choices on predicted TTFT (a Ray Serve ``RequestRouter``).

Mitzenmacher's power of two choices ("The Power of Two Choices in Randomized Load
Balancing", IEEE TPDS 2001): sampling two replicas and taking the less loaded one gets
exponentially better maximum load than one random choice, while needing no global view.
Our load measure is the request's predicted TTFT on that replica
(:meth:`policies.AdmissionController.predict`), from the load snapshot each replica
publishes through Ray Serve's ``record_routing_stats``, which weighs queued prefill
tokens and running decodes instead of counting requests.

Snapshots are at most a stats period old (plus the controller's broadcast delay), so a
burst routed between two snapshots would all pick the same "idle" replica. The router
therefore remembers what it routed since each replica's snapshot was taken and counts it
as waiting on that replica. The decisions themselves are Ray-free
(:class:`router.choice.ReplicaChooser`, :class:`router.choice.RoutedSince`), so the
simulator runs them too; :class:`router.request_router.LoadAwareRouter` wraps them.

A router lives in every process that holds a handle to the model deployment (the
ingress). The ingress reads the same adjusted snapshots for admission through
:func:`load_view`.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from ray.serve.request_router import PendingRequest

from router.choice import RequestShape

__all__ = ["RequestShape", "load_view", "register", "shape_of"]

if TYPE_CHECKING:
    from router.request_router import LoadAwareRouter


def shape_of(pending: PendingRequest | None) -> RequestShape | None:
    """The shape the ingress attached to a call (``shape=`` keyword), if any."""
    if pending is None:
        return None
    shape = pending.kwargs.get("shape")
    return shape if isinstance(shape, RequestShape) else None


def pinned_replica(pending: PendingRequest | None) -> str | None:
    """The replica id a call names with its ``pin=`` keyword (a replica's step-items
    stream, which must reach that replica), if any."""
    pin = None if pending is None else pending.kwargs.get("pin")
    return pin if isinstance(pin, str) else None


_routers: weakref.WeakSet[LoadAwareRouter] = weakref.WeakSet()
"""Live routers in this process; the ingress finds its handle's router here."""


def register(router: LoadAwareRouter) -> None:
    _routers.add(router)


def load_view(app_name: str, deployment_name: str) -> LoadAwareRouter | None:
    """This process's router for a deployment (created with its handle's first call)."""
    for r in list(_routers):
        dep = r._deployment_id
        if dep.name == deployment_name and dep.app_name == app_name:
            return r
    return None
