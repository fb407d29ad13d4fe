"""What every call to a replica shares, wherever the replica runs: its first item and the
metrics record of its items.

A call (:class:`router.contract.ReplicaCall`: :class:`router.dispatch.RayCall` through
Ray Serve, :class:`router.local.LocalCall` in process) answers ``start()`` once the
replica accepted the request, then ``items()`` (one :class:`router.contract.StepItem` per
step that produced tokens), ``cancel()``, and the attributes ``prompt_tokens``,
``cached_tokens`` and ``replica`` (:mod:`router.responses` reads them).
"""

from __future__ import annotations

from router.contract import Accepted, FirstItem, Refused, StepItem
from router.errors import ApiError
from router.metrics import RequestRecord

RETRY_AFTER_S = 5
"""``Retry-After`` seconds of a 503 for a request no replica could serve: about the time
Ray Serve takes to start a replica in place of one that died."""


class ReplicaLost(Exception):
    """The replica serving a request failed and the request could not move to another
    (none is alive, or the request cannot migrate): a stream ends with an error event,
    a whole response is a 503 with ``Retry-After``."""


def accepted(first: FirstItem) -> Accepted:
    """The replica's acceptance of the request.

    Raises:
        ApiError: the replica refused the request (its status, message and field).
    """
    if isinstance(first, Refused):
        raise first.error()
    return first


def request_failed(item: StepItem) -> ApiError:
    """The answer to a request whose replica reported it failed inside the engine
    (:attr:`StepItem.error`): 503 ``request_failed``. Not bad input (no 4xx), and not the
    replica's loss: the engine went on, and a retry may well succeed."""
    return ApiError(503, f"the request failed in the engine: {item.error}", code="request_failed")


def record_item(record: RequestRecord | None, item: StepItem) -> None:
    """Tell ``record`` (or nobody) of one step's item."""
    if record is None:
        return
    if item.queue_s is not None:
        record.scheduled(item.queue_s)
    record.tokens(
        sum(len(o.token_ids) for o in item.outputs),
        [o.finish_reason for o in item.outputs if o.finish_reason],
    )
    if item.finished:
        record.finished()
