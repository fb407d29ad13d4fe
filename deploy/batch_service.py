"""A batch sent to a running iterserve service (``--via-service URL``).

Every request carries ``x-iterserve-class: batch``: the service holds batch requests under
load rather than refusing them, schedules them behind the interactive classes, and never
admits them into the SLO headroom those classes need. At most ``concurrency`` requests
are in flight. A 429 or 503 is retried after its ``Retry-After`` (1 s without one), as is
a connection error; a request that still fails after ``max_retries`` is not written, so
a rerun sends it again. Once one request has given up, the service is taken to be down:
the requests not yet sent are not sent (each would wait out its own retries: an hour for
a thousand lines against a mistyped URL) and count as unanswered.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import httpx

from deploy.batch_format import BATCH_CLASS
from router.responses import Answer
from router.tenants import CLASS_HEADER

RETRY_STATUSES = (429, 503)
DEFAULT_CONCURRENCY = 8
"""Requests in flight at most, unless ``--max-concurrency`` says otherwise."""
AUTH_FAILED = 401
"""The service refused the key: every line would fail alike, so nothing is written."""


class ServiceGaveUp(RuntimeError):
    """Some requests could not be answered by the service; a rerun resumes them."""


class _NoAnswer(Exception):
    """One request's retries ran out; the message is its last failure."""


def _failure(resp: httpx.Response | None, error: Exception | None) -> str:
    if resp is not None:
        return f"HTTP {resp.status_code}"
    return f"could not reach it ({type(error).__name__}: {error})"


def _retry_after(resp: httpx.Response | None) -> float:
    try:
        return max(0.1, float(resp.headers.get("retry-after", 1)))
    except (AttributeError, ValueError):
        return 1.0


async def _send(client: httpx.AsyncClient, url: str, body: dict, max_retries: int) -> Answer:
    """The service's answer.

    A 429 means the service is holding work back for its SLOs: it is always retried and
    does not count against ``max_retries``.

    Raises:
        _NoAnswer: after ``max_retries`` + 1 retryable failures in a row.
        ServiceGaveUp: the service refused the key (401).
    """
    failures, error = 0, None
    while failures <= max_retries:
        try:
            resp = await client.post(url, json=body)
        except httpx.TransportError as e:
            resp, error = None, e
        if resp is not None and resp.status_code == AUTH_FAILED:
            raise ServiceGaveUp(
                f"the service refused the API key ({resp.text[:300]}); set "
                "OPENAI_API_KEY to a key it accepts and rerun"
            )
        if resp is not None and resp.status_code not in RETRY_STATUSES:
            try:
                data = resp.json()
            except ValueError:  # not the API's answer (a proxy's error page, say)
                data = {"error": {"message": resp.text[:500], "code": str(resp.status_code)}}
            tokens = (data.get("usage") or {}).get("completion_tokens", 0)
            return Answer(
                resp.status_code,
                resp.headers.get("x-request-id", ""),
                data,
                tokens if resp.status_code == 200 else 0,
            )
        if resp is None or resp.status_code != 429:
            failures += 1
        if failures <= max_retries:
            await asyncio.sleep(_retry_after(resp))
    raise _NoAnswer(_failure(resp, error))


async def run_via_service(
    base_url: str,
    work: list[tuple[str, str, dict]],
    done: Callable[[str, Answer], None],
    concurrency: int = DEFAULT_CONCURRENCY,
    max_retries: int = 30,
    timeout_s: float = 600.0,
    transport: httpx.AsyncBaseTransport | None = None,
) -> None:
    """Send every ``(custom_id, url path, body)`` of ``work`` to the service at
    ``base_url``; ``done`` is called as each is answered.

    Sends ``Authorization: Bearer $OPENAI_API_KEY`` when that variable is set.
    ``transport`` replaces the network (tests).

    Raises:
        ServiceGaveUp: when a request ran out of retries, once the requests then in
            flight have finished (the rest are not sent; all count as unanswered); at
            once, when the service refuses the key (401).
    """
    headers = {CLASS_HEADER: BATCH_CLASS}
    if key := os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {key}"
    queue: asyncio.Queue = asyncio.Queue()
    for item in work:
        queue.put_nowait(item)
    unanswered: list[str] = []
    failures: list[str] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty() and not failures:
            cid, path, body = queue.get_nowait()
            try:
                done(cid, await _send(client, path, body, max_retries))
            except _NoAnswer as e:
                unanswered.append(cid)
                failures.append(str(e))

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=base_url.rstrip("/"),
        headers=headers,
        timeout=timeout_s,
        limits=limits,
        transport=transport,
    ) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    while not queue.empty():
        unanswered.append(queue.get_nowait()[0])
    if unanswered:
        raise ServiceGaveUp(
            f"{len(unanswered)} requests got no answer from {base_url} "
            f"(e.g. {unanswered[0]!r}: {failures[0]}, {max_retries} retries); "
            "they were not written: rerun the same command to send them"
        )
