"""How the model deployment's router chooses, and what it shares with the ingress: the
method (power of two choices on predicted TPOT and TTFT), the routers' registry, the load
view that admission reads, and what a routed call carries.

Mitzenmacher's power of two choices ("The Power of Two Choices in Randomized Load
Balancing", IEEE TPDS 2001): sampling two replicas and taking the less loaded one gets
exponentially better maximum load than one random choice, while needing no global view.
Our load measures are the request's predicted TPOT on that replica (the step time with
every request it holds decoding, this one included, against the TPOT SLO) and its
predicted TTFT (:meth:`policies.AdmissionController.predict`), from the load snapshot each
replica publishes through Ray Serve's ``record_routing_stats``, which weigh queued prefill
tokens and decodes instead of counting requests
(:meth:`router.choice.ReplicaChooser.first_is_better`).

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
from collections.abc import Mapping
from typing import Protocol

from policies import LoadSnapshot
from router.contract import RequestShape

__all__ = ["LoadView", "PendingRequest", "load_view", "pinned_replica", "register", "shape_of"]


class PendingRequest(Protocol):
    """What :func:`shape_of` and :func:`pinned_replica` read of a call being routed (Ray
    Serve's ``PendingRequest``): its keyword arguments. This module imports no Ray, so
    that the ingress, which imports it, runs without Ray in process."""

    @property
    def kwargs(self) -> Mapping[str, object]: ...


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


class LoadView(Protocol):
    """What the ingress reads of its process's router
    (:class:`router.request_router.LoadAwareRouter`)."""

    def observe_load(self, replica_unique_id: str, snap: LoadSnapshot) -> None:
        """A load the replica sent with a stream item."""
        ...

    def loads_for(self, shape: RequestShape) -> list[tuple[LoadSnapshot, int]]:
        """Each replica's adjusted snapshot and the tokens of ``shape``'s prompt it
        likely holds."""
        ...

    def unique_snapshots(self) -> dict[str, LoadSnapshot]:
        """Each running replica's adjusted snapshot by its unique id."""
        ...

    def replica_stats(self) -> dict[str, dict]:
        """Each running replica's last published routing stats by its unique id."""
        ...

    def num_replicas(self) -> int:
        """Replicas running now."""
        ...

    def replica_ids(self) -> set[str]:
        """The unique ids of the replicas running now (those Serve routes to)."""
        ...

    def replica_died(self, replica_unique_id: str) -> None:
        """A call to the replica failed because its actor died: route nothing more to it,
        and leave it out of every view (``/health`` included) from now on, without
        waiting for Serve's controller to notice."""
        ...


_routers: weakref.WeakKeyDictionary[LoadView, tuple[str, str]] = weakref.WeakKeyDictionary()
"""Live routers in this process, with the (app, deployment) each routes to; the ingress
finds its handle's router here."""


def register(router: LoadView, app_name: str, deployment_name: str) -> None:
    """Make ``router`` the load view of deployment ``deployment_name`` of ``app_name``."""
    _routers[router] = (app_name, deployment_name)


def load_view(app_name: str, deployment_name: str) -> LoadView | None:
    """This process's router for a deployment (created with its handle's first call)."""
    for router, names in list(_routers.items()):
        if names == (app_name, deployment_name):
            return router
    return None
