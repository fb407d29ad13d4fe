"""What admission decides (:class:`Admit`, :class:`Wait`, :class:`Reject`) and predicts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Admit:
    """Send the request to the replica now."""


@dataclass(frozen=True, slots=True)
class Wait:
    """Hold the request; decide again within ``max_wait_s`` seconds (or on new load)."""

    max_wait_s: float
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Reject:
    """Refuse the request; the client may retry after ``retry_after_s`` (whole seconds)."""

    retry_after_s: float
    reason: str
    kind: str = "ttft"
    """What failed first, a bounded label for metrics: ``ttft``, ``tpot``, ``seats``,
    ``kv_cache`` or ``queue_cap``."""


Decision = Admit | Wait | Reject


@dataclass(frozen=True, slots=True)
class Prediction:
    """What :meth:`AdmissionController.predict` expects for a request on a replica."""

    ttft_s: float
    """Seconds from admission to the first token (time already waited not included)."""
    tpot_s: float
    """Mean seconds per output token that running requests would see."""
    tpot_slo_s: float
    """The TPOT SLO the prediction must meet: the tightest among the classes running and
    the new request's; under a replica's TPOT guard, the new request's own."""
    tokens_ahead: int
    """Queued prefill tokens that the request waits for."""
    requests_ahead: int
    """Queued requests of classes that go before it."""
    steps: int
    """Steps until its prompt is prefilled."""
    seats_free: bool
    """``max_num_seqs`` leaves room for it after the requests that go before it."""
    kv_fits: bool
    """Free (or reclaimable) KV blocks hold the prefill ahead and its prompt."""
