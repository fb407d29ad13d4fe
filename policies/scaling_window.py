"""Per-class counts over a sliding window: what the autoscaler reads of the traffic.

The ingress (live) and the simulator's fleet (virtual time) report the same events here,
so :class:`policies.autoscale.SloAutoscaler` sees the same inputs in both. Pure Python.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from policies.autoscale import ClassLoad


@dataclass(frozen=True, slots=True)
class _Arrival:
    t: float
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class _Finish:
    t: float
    met: bool
    output_tokens: int


class ClassWindow:
    """Arrivals, refusals and finishes of each traffic class over the last ``window_s``.

    Times are seconds on one clock that only moves forward (``time.monotonic()`` live,
    virtual time in the simulator). Not thread-safe: call from one thread or event loop.

    Args:
        window_s: seconds of history :meth:`loads` counts.

    Raises:
        ValueError: ``window_s`` is not positive.
    """

    def __init__(self, window_s: float) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s={window_s!r}: must be > 0")
        self.window_s = window_s
        self._arrivals: dict[str, deque[_Arrival]] = {}
        self._finishes: dict[str, deque[_Finish]] = {}
        self._refusals: dict[str, deque[float]] = {}
        self._start: float | None = None

    def _seen(self, t: float) -> None:
        if self._start is None:
            self._start = t

    def arrived(self, traffic_class: str, t: float, prompt_tokens: int, max_tokens: int) -> None:
        """A request arrived at ``t`` (before admission decides)."""
        self._seen(t)
        self._arrivals.setdefault(traffic_class, deque()).append(
            _Arrival(t, prompt_tokens, max_tokens)
        )

    def refused(self, traffic_class: str, t: float) -> None:
        """Admission refused a request (429) at ``t``."""
        self._seen(t)
        self._refusals.setdefault(traffic_class, deque()).append(t)

    def finished(self, traffic_class: str, t: float, met: bool, output_tokens: int) -> None:
        """A request finished at ``t``; ``met``: within both SLOs of its class, its TTFT
        counted from its arrival at the ingress."""
        self._seen(t)
        self._finishes.setdefault(traffic_class, deque()).append(_Finish(t, met, output_tokens))

    def _trim(self, now: float) -> None:
        cut = now - self.window_s
        for q in (*self._arrivals.values(), *self._finishes.values()):
            while q and q[0].t < cut:
                q.popleft()
        for r in self._refusals.values():
            while r and r[0] < cut:
                r.popleft()

    def span_s(self, now: float) -> float:
        """Seconds the counts cover: ``window_s``, or less since the first event."""
        if self._start is None:
            return self.window_s
        return max(1e-9, min(self.window_s, now - self._start))

    def loads(
        self, now: float, held: Mapping[str, Iterable[float]] | None = None
    ) -> dict[str, ClassLoad]:
        """Each class's :class:`ClassLoad` at ``now``.

        Args:
            now: the current time on the events' clock.
            held: per class, the arrival times of the requests admission holds now.
        """
        self._trim(now)
        held = held or {}
        names = set(self._arrivals) | set(self._finishes) | set(self._refusals) | set(held)
        out = {}
        for name in sorted(names):
            arrivals = self._arrivals.get(name, ())
            finishes = self._finishes.get(name, ())
            held_at = list(held.get(name, ()))
            if finishes:
                output = sum(f.output_tokens for f in finishes) / len(finishes)
            elif arrivals:
                output = sum(a.max_tokens for a in arrivals) / len(arrivals)
            else:
                output = 0.0
            out[name] = ClassLoad(
                arrived=len(arrivals),
                prompt_tokens=sum(a.prompt_tokens for a in arrivals),
                output_tokens=output,
                finished=len(finishes),
                met=sum(f.met for f in finishes),
                refused=len(self._refusals.get(name, ())),
                held=len(held_at),
                oldest_held_s=max((now - t for t in held_at), default=0.0),
            )
        return out
