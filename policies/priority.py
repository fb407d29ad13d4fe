"""Priority scheduling with aging, and the traffic classes that give requests a priority.

A traffic class names a kind of traffic (interactive chat, standard API calls, offline
batch work) and carries its latency SLOs, its default priority and how long it may queue.
:class:`PriorityPolicy` serves lower priority values first; waiting time lowers a
request's effective priority ("aging", the classic remedy for starvation under static
priorities), so batch work always progresses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies.base import R


@dataclass(frozen=True, slots=True)
class TrafficClass:
    """A kind of traffic: its SLOs and how the router and scheduler treat it.

    Raises:
        ValueError: a field is out of range; the message names the field and value.
    """

    name: str
    ttft_slo_s: float
    """Time to first token, seconds from arrival, that a request of the class should meet."""
    tpot_slo_s: float
    """Mean time per output token after the first, seconds."""
    default_priority: int
    """The priority its requests get when they do not set one (lower is more urgent)."""
    max_queue_wait_s: float
    """Seconds a request may be held (``Wait``) before admission rejects or re-queues it."""
    hard_queue_cap: int | None = None
    """Waiting requests of the class at most; at the cap new ones are rejected. None: no cap."""
    rejectable: bool = True
    """False: never rejected for its SLO, only for ``hard_queue_cap`` (work that must run)."""
    scale_share: float = 1.0
    """The most of the autoscaler's ``max_replicas``, as a fraction, that this class's
    demand alone may scale the fleet to (:mod:`policies.autoscale`): under 1 for work that
    can wait."""

    def __post_init__(self) -> None:
        checks = [
            ("name", self.name, isinstance(self.name, str) and bool(self.name), "non-empty"),
            ("ttft_slo_s", self.ttft_slo_s, _positive(self.ttft_slo_s), "must be > 0"),
            ("tpot_slo_s", self.tpot_slo_s, _positive(self.tpot_slo_s), "must be > 0"),
            (
                "default_priority",
                self.default_priority,
                isinstance(self.default_priority, int),
                "must be an int",
            ),
            (
                "max_queue_wait_s",
                self.max_queue_wait_s,
                _positive(self.max_queue_wait_s) or self.max_queue_wait_s == 0,
                "must be >= 0",
            ),
            (
                "hard_queue_cap",
                self.hard_queue_cap,
                self.hard_queue_cap is None or self.hard_queue_cap >= 1,
                "must be >= 1 or None",
            ),
            ("scale_share", self.scale_share, 0 <= self.scale_share <= 1, "must be in [0, 1]"),
        ]
        for field_name, value, ok, rule in checks:
            if not ok:
                raise ValueError(f"TrafficClass.{field_name}={value!r}: {rule}")


def _positive(x: float) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


DEFAULT_CLASS = "standard"
"""The class of a request that names none (and of every request of a one-class service)."""

DEFAULT_CLASSES: dict[str, TrafficClass] = {
    # SLOs sized for SmolLM2-135M on a small CPU host, where a step takes a tenth of a second
    # or more; override them (make_classes) for faster hardware.
    "interactive": TrafficClass(
        "interactive", ttft_slo_s=2.0, tpot_slo_s=0.5, default_priority=0, max_queue_wait_s=1.0
    ),
    DEFAULT_CLASS: TrafficClass(
        DEFAULT_CLASS, ttft_slo_s=5.0, tpot_slo_s=1.0, default_priority=1, max_queue_wait_s=3.0
    ),
    "batch": TrafficClass(
        "batch",
        ttft_slo_s=60.0,
        tpot_slo_s=5.0,
        default_priority=2,
        max_queue_wait_s=30.0,
        hard_queue_cap=1000,
        rejectable=False,
        scale_share=0.5,
    ),
}
"""The built-in classes by name. Do not mutate; build a variant with :func:`make_classes`."""


def make_classes(
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    base: Mapping[str, TrafficClass] = DEFAULT_CLASSES,
) -> dict[str, TrafficClass]:
    """``base`` with per-class field overrides applied: the one builder of traffic classes,
    from a YAML config's partial overrides or from every class's complete fields as
    ``dataclasses.asdict`` wrote them (JSON, for Serve's router arguments).

    Args:
        overrides: class name -> {field: value}; None: ``base`` as it is. A known class
            keeps the fields not given; a new name needs every required field of
            :class:`TrafficClass`.
        base: the classes to start from.

    Raises:
        ValueError: an unknown field, a missing field of a new class, or a bad value.
    """
    classes = dict(base)
    fields = {f.name for f in dataclasses.fields(TrafficClass)}
    for name, values in (overrides or {}).items():
        unknown = set(values) - fields
        if unknown:
            raise ValueError(f"traffic class {name!r}: unknown fields {sorted(unknown)}")
        values = {**values, "name": name}
        if name in classes:
            classes[name] = dataclasses.replace(classes[name], **values)
            continue
        missing = sorted(
            f.name
            for f in dataclasses.fields(TrafficClass)
            if f.default is dataclasses.MISSING and f.name not in values
        )
        if missing:
            raise ValueError(
                f"traffic class {name!r} is new (known: {sorted(classes)}): "
                f"give {', '.join(missing)} too"
            )
        classes[name] = TrafficClass(**values)
    return classes


class PriorityPolicy:
    """Most urgent effective priority first, then earliest arrival; preempts less urgent work.

    Effective priority of a waiting request at time ``now`` (seconds)::

        priority - (now - start) / aging_s_per_level,
        start = max(arrival_time, last admission of a request of the same priority)

    so each ``aging_s_per_level`` seconds that its priority level goes unserved is worth
    one level. Every request ages at the same rate, so between admissions the order never
    changes with ``now``: it is the order of ``start + priority * aging_s_per_level``, a
    virtual deadline (like earliest-deadline-first). A request of priority ``p`` whose
    level was last served at ``t0`` is ahead of every request of priority ``p_new``
    arriving after ``t0 + (p - p_new) * aging_s_per_level``: under any stream of more
    urgent arrivals its level is served within that bound, so batch work always
    progresses. Counting from the level's last admission rather than from arrival is what
    keeps a backlog of less urgent work, while its level is being served, from aging
    ahead of fresh urgent arrivals: with plain arrival-time aging, a batch backlog older
    than ``(p - p_new) * aging_s_per_level`` (20 s for batch over interactive by default)
    would hold every interactive arrival behind it for as long as batch traffic exceeds
    capacity. An admitted request keeps the deadline it was admitted with (also after a
    preemption), so it neither loses its place nor can be thrashed by the aging of others.

    Args:
        aging_s_per_level: seconds of waiting that gain one priority level; None or
            ``math.inf`` disables aging (strict priorities, which can starve).
        max_head_of_line_skips: later requests that may be admitted past a head lacking
            KV room before the scheduler waits for room for the head.

    Raises:
        ValueError: ``aging_s_per_level`` is not > 0, or ``max_head_of_line_skips`` < 0.
    """

    by_priority = True

    def __init__(
        self, aging_s_per_level: float | None = 10.0, max_head_of_line_skips: int = 8
    ) -> None:
        if aging_s_per_level is not None and not aging_s_per_level > 0:
            raise ValueError(f"aging_s_per_level={aging_s_per_level!r}: must be > 0 or None")
        if max_head_of_line_skips < 0:
            raise ValueError(f"max_head_of_line_skips={max_head_of_line_skips!r}: must be >= 0")
        self.aging_s_per_level = (
            None
            if aging_s_per_level is None or math.isinf(aging_s_per_level)
            else float(aging_s_per_level)
        )
        self.max_head_of_line_skips = max_head_of_line_skips
        self._level_served: dict[int, float] = {}
        """Priority level -> when a request of it was last admitted (engine clock, s)."""
        self._admitted_deadline: dict[str, float] = {}
        """Request id -> its virtual deadline when admitted, until it leaves the engine."""

    def _deadline(self, request: R) -> float:
        """``start + priority * aging_s_per_level`` (see the class docstring)."""
        kept = self._admitted_deadline.get(request.request_id)
        if kept is not None:
            return kept
        start = max(
            request.arrival_time, self._level_served.get(request.priority, request.arrival_time)
        )
        return start + request.priority * self.aging_s_per_level

    def effective_priority(self, request: R, now: float) -> float:
        """``request``'s priority less one level per ``aging_s_per_level`` s of waiting
        while its level went unserved (see the class docstring)."""
        if self.aging_s_per_level is None:
            return float(request.priority)
        return (self._deadline(request) - now) / self.aging_s_per_level

    def _key(self, request: R) -> tuple[float, float]:
        # (effective priority, arrival) in its time-invariant form: sorting on it is the
        # same as sorting on effective priority at any ``now``, with no rounding from
        # subtracting ``now``, and equal keys are exact ties broken by arrival.
        if self.aging_s_per_level is None:
            return (request.priority, request.arrival_time)
        return (self._deadline(request), request.arrival_time)

    def order(self, requests: Sequence[R], now: float) -> list[R]:
        # Running requests use the same key: decodes of the most urgent are served first.
        return sorted(requests, key=self._key)

    def pick_victim(self, running: Sequence[R]) -> R:
        """The least urgent running request by raw priority, latest arrival among equals.

        Raw, not aged: the victim loses its KV, and the latest arrival of the lowest class
        has the least work to recompute and is also the last in :meth:`order` among them.
        """
        return max(running, key=lambda r: (r.priority, r.arrival_time))

    def preempts(self, waiting: R, running: R, now: float) -> bool:
        """Whether ``waiting`` outranks ``running`` enough to take its seat and KV.

        Both must hold:

        1. ``waiting``'s effective priority is at least one whole level more urgent than
           ``running``'s raw priority. Without aging this is plain "strictly more urgent";
           with aging, a request must have waited long enough to gain a full level, not a
           fraction of one, before it may displace work of its own class (hysteresis: a
           marginal crossing of the boundary does not cost a recompute).
        2. ``waiting`` comes strictly before ``running`` in :meth:`order`. Comparing only
           with ``running``'s raw priority would let a long-waiting request preempt a
           same-class one, whose own age (arrival is kept across preemption) then lets it
           preempt straight back: thrash. Once admitted, a request's key is fixed (see the
           class docstring), so a victim can never preempt the request that displaced it,
           and a request that has aged ahead of fresh urgent arrivals keeps its place while
           it runs, which is what bounds its wait.
        """
        if self.effective_priority(waiting, now) > running.priority - 1:
            return False
        return self._key(waiting) < self._key(running)

    def outranks(self, a: R, b: R) -> bool:
        """Strictly more urgent raw priority. Aging orders waiting requests; it must not
        let a decode that has run for ``aging_s_per_level`` seconds rank above fresh
        prompts of its own class (which would then lose their TTFT to its TPOT)."""
        return a.priority < b.priority

    def may_admit(self, request: R, num_running: int, num_waiting: int, now: float) -> bool:
        return True

    def on_admit(self, request: R, now: float) -> None:
        if self.aging_s_per_level is None:
            return
        self._admitted_deadline.setdefault(request.request_id, self._deadline(request))
        served = self._level_served.get(request.priority, now)
        self._level_served[request.priority] = max(served, now)

    def on_finish(self, request: R) -> None:
        self._admitted_deadline.pop(request.request_id, None)
