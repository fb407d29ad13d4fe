"""What every call to a replica shares, wherever the replica runs: its first item and the
metrics record of its items.

A call (:class:`router.dispatch.Dispatch` through Ray Serve, :class:`router.local.LocalCall`
in process) answers ``start()`` once the replica accepted the request, then ``items()``
(one dict per step that produced tokens), ``cancel()``, and the attributes
``prompt_tokens``, ``cached_tokens`` and ``replica`` (:mod:`router.responses` reads them).
"""

from __future__ import annotations

from typing import Any

from router.errors import ApiError


class ReplicaLost(Exception):
    """The replica serving a stream died after it had produced tokens."""


def accepted(first: dict) -> tuple[int, str]:
    """The prompt's length and the replica's id from a replica's first item.

    Raises:
        ApiError: the replica refused the request (its status, message and field).
    """
    if "error" in first:
        err = first["error"]
        raise ApiError(err["status"], err["message"], param=err.get("param"), code=err.get("code"))
    return first["prompt_tokens"], first["replica"]


def record_item(record: Any, item: dict) -> None:
    """Tell ``record`` (``deploy.metrics.RequestRecord``, or None) of one step's item."""
    if record is None:
        return
    if "queue_s" in item:
        record.scheduled(item["queue_s"])
    record.tokens(
        sum(len(o["token_ids"]) for o in item["outputs"]),
        [o["finish_reason"] for o in item["outputs"] if o["finish_reason"]],
    )
    if item["finished"]:
        record.finished()
