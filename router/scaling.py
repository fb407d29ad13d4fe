"""What the ingress tells the autoscaler, and what it learns back of its decisions.

The ingress sees every request of every class: its arrival, its refusal (429) and its end
within or outside its SLOs. :class:`ScalingSignals` counts them over the policy's window
(:class:`policies.scaling_window.ClassWindow`), with the requests admission holds, and
encodes them for the controller (:func:`policies.scaling_signals.encode_classes`); the
Ray ingress (:class:`router.api.OpenAIIngress`) sends them to every model replica, whose
``record_autoscaling_stats`` passes them on to Ray Serve's controller, where
:class:`deploy.autoscale.ServePolicy` decides.

The controller's policy publishes each decision (:class:`ScalingRecord`) in the Ray
cluster's key-value store (:mod:`router.scaling_store`), the one store both processes
reach; the Ray ingress reads it back for ``/health`` and ``iterserve:num_replicas_target``.
This module imports no Ray: the in-process ingress counts with it too.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass

from policies.autoscale import ClassLoad
from policies.scaling_signals import encode_classes
from policies.scaling_window import ClassWindow


class ScalingSignals:
    """The ingress's per-class counts for the autoscaler. Its owner calls :meth:`encode`
    every decision period: the window forgets old events only then.

    Args:
        classes: every traffic class's name (each is sent, with zeros when idle, so that
            the controller can tell an idle class from a lost message).
        window_s: seconds of history (the policy's ``window_s``).
        held: per class, the arrival times of the requests admission holds now
            (:meth:`router.admission.IngressAdmission.held_arrivals`), on ``clock``.
        clock: monotonic seconds (the ingress's request times).
        wall: Unix seconds (the stamp the controller compares with its own clock).
    """

    def __init__(
        self,
        classes: Iterable[str],
        window_s: float,
        held: Callable[[], Mapping[str, Iterable[float]]],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.classes = tuple(classes)
        self.window = ClassWindow(window_s)
        self._held, self.clock, self.wall = held, clock, wall

    def arrived(self, traffic_class: str, t: float, prompt_tokens: int, max_tokens: int) -> None:
        """A request (one prompt) arrived at ``t``, before admission decided."""
        self.window.arrived(traffic_class, t, prompt_tokens, max_tokens)

    def refused(self, traffic_class: str) -> None:
        """Admission refused a request now (429)."""
        self.window.refused(traffic_class, self.clock())

    def ended(self, traffic_class: str, met: bool, output_tokens: int) -> None:
        """A request ended now: finished (``met``: within both SLOs of its class) or failed
        with its replica (``met`` False)."""
        self.window.finished(traffic_class, self.clock(), met, output_tokens)

    def loads(self) -> tuple[dict[str, ClassLoad], float]:
        """Every class's load now, and the seconds it covers."""
        now = self.clock()
        loads = self.window.loads(now, self._held())
        every = {c: loads.get(c, ClassLoad()) for c in {*self.classes, *loads}}
        return every, self.window.span_s(now)

    def encode(self) -> dict[str, float]:
        """:meth:`loads` in the form that travels (:mod:`policies.scaling_signals`)."""
        loads, span = self.loads()
        return encode_classes(loads, span, self.wall())


@dataclass(frozen=True, slots=True)
class ScalingRecord:
    """One decision of the autoscaler, as the ingress shows it."""

    target: int
    """Replicas asked for."""
    reason: str
    """Why, in words (:attr:`policies.autoscale.ScalingDecision.reason`)."""
    running: int
    """Replicas running when it decided."""
    at: float
    """When, Unix seconds."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> ScalingRecord:
        """Raises:
        ValueError: not a record's JSON."""
        try:
            d = json.loads(text)
            return cls(int(d["target"]), str(d["reason"]), int(d["running"]), float(d["at"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not an autoscaling record: {e}") from None
