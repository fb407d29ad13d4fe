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
as waiting on that replica (:class:`router.request_router.LoadAwareRouter`).

A router lives in every process that holds a handle to the model deployment (the
ingress). The ingress reads the same adjusted snapshots for admission through
:func:`load_view`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ray.serve.request_router import PendingRequest

if TYPE_CHECKING:
    from router.request_router import LoadAwareRouter

ROUTED_MEMORY_S = 5.0
"""Seconds a routed request is remembered when no newer snapshot has counted it."""


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What routing and admission need to know of a request (sent as the call's kwargs)."""

    prompt_tokens: int
    traffic_class: str
    priority: int
    prefix_hashes: tuple[int, ...] = ()
    """:func:`router.prefix.prefix_hashes` of the prompt; empty: no prefix affinity."""


@dataclass(frozen=True, slots=True)
class Routed:
    time_s: float
    """``time.time()`` when routed (snapshots carry ``time.time()`` too)."""
    shape: RequestShape


def shape_of(pending: PendingRequest | None) -> RequestShape | None:
    """The shape the ingress attached to a call (``shape=`` keyword), if any."""
    if pending is None:
        return None
    shape = pending.kwargs.get("shape")
    return shape if isinstance(shape, RequestShape) else None


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
