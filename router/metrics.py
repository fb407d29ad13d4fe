"""Prometheus metrics at the ingress: every name and label iterserve exports, in one place.

Names follow vLLM's (``vllm:time_to_first_token_seconds`` is
``iterserve:time_to_first_token_seconds`` here, and so on), so that dashboards and alerts
written for vLLM translate by a prefix swap. Everything is served at ``GET /metrics`` on
the API port by ``prometheus-client``, from the ingress process. Ray's own metrics export
was not used: it serves each node's metrics agent on another port, prefixes names with
``ray_``, and would need Ray's service discovery in every Prometheus config.

Two sources feed it:

* the ingress measures each request as its client sees it (:class:`RequestRecord`): TTFT,
  inter-token latency, TPOT, end-to-end latency, queue time, tokens, finish reasons,
  aborts, admission rejections, SLO outcomes, and embedding inputs and their tokens;
* each replica counts its own steps (:class:`engine.core.step_metrics.StepMetrics`: step time,
  prefill and decode tokens per step, preemptions, with their buckets) and checks their
  times against the simulator's step-time model (:class:`engine.core.step_drift.DriftMonitor`);
  the cumulative counts and the drift travel with the load snapshot Ray Serve already
  polls from every replica (``record_routing_stats``), and the ingress renders them with
  the snapshots' gauges (running, waiting, KV usage) per replica (:func:`replica_families`).

Labels: ``model``, ``replica``, ``traffic_class``, plus ``reason``, ``finish_reason``,
``phase`` or ``kind`` (a step's: decode, mixed, prefill) where they apply. No request ids
or tenant names: the label sets are bounded by the configured classes and the replicas.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

PREFIX = "iterserve:"
# No `_created` series beside every counter and histogram: vLLM's exposition has none, and
# they double the series a scrape stores.
disable_created_metrics()
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Buckets in seconds: vLLM's for TTFT and ITL, extended to the SLO range of CPU serving.
TTFT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)

ATTAINMENT_WINDOW_S = 60.0
"""The rolling SLO-attainment gauge covers requests ended in this many seconds."""

REJECT_REASONS = ("ttft", "tpot", "seats", "kv_cache", "queue_cap", "queue_timeout")
"""The reasons to refuse a request: admission's (``policies.Reject.kind``), and
``queue_timeout``: the request could not start within its queue bound (held by
admission for all of it, or queued on a replica past it; ``router.ingress``)."""


def _histogram(
    name: str,
    doc: str,
    labels: list[str],
    data: Iterable[tuple[list[str], Mapping[str, Any]]],
) -> HistogramMetricFamily:
    """A histogram family from replicas' ``engine.core.step_metrics.Buckets.to_dict`` dicts."""
    fam = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
    for values, h in data:
        counts, running, buckets = h["counts"], 0, []
        for bound, n in zip([*map(str, h["bounds"]), "+Inf"], counts):
            running += n
            buckets.append((bound, running))
        fam.add_metric(values, buckets, h["sum"])
    return fam


class IngressMetrics:
    """The ingress's registry: per-request metrics it measures, and the replicas' and
    admission's state read at each scrape.

    Args:
        model: the served model's name (the ``model`` label).
        slos: ``{class: (ttft_slo_s, tpot_slo_s)}``.
        replica_stats: at scrape, ``{replica id: routing stats dict}`` of live replicas.
        held: at scrape, requests held by admission now, per class.
        replicas: at scrape, model replicas running now.
        target_replicas: model replicas the application asks for.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        model: str,
        slos: Mapping[str, tuple[float, float]],
        replica_stats: Callable[[], Mapping[str, Mapping[str, Any]]],
        held: Callable[[], Mapping[str, int]],
        replicas: Callable[[], int],
        target_replicas: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model, self.slos, self.clock = model, dict(slos), clock
        self._replica_stats, self._held = replica_stats, held
        self._replicas, self.target_replicas = replicas, target_replicas
        self.on_end: Callable[[str, bool, int], None] | None = None
        """Told of each request that finished or failed after admission: its class,
        whether it met both SLOs (a failed one did not), and its output tokens (the
        autoscaler's window, :class:`router.scaling.ScalingSignals`)."""
        self.started = time.time()
        self.registry = CollectorRegistry(auto_describe=True)
        self._outcomes: dict[str, deque[tuple[float, bool]]] = {c: deque() for c in slos}
        labels = ["model", "traffic_class"]

        def hist(name: str, doc: str, bounds: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=bounds, registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=self.registry)

        self.ttft = hist(
            "time_to_first_token_seconds",
            "Seconds from arrival at the ingress to the first token.",
            TTFT_BUCKETS,
        )
        self.itl = hist(
            "inter_token_latency_seconds",
            "Seconds between a request's successive streamed tokens.",
            ITL_BUCKETS,
        )
        self.tpot = hist(
            "request_time_per_output_token_seconds",
            "Per request: (last token - first token) / (output tokens - 1).",
            ITL_BUCKETS,
        )
        self.e2e = hist(
            "e2e_request_latency_seconds", "Seconds from arrival to the last token.", E2E_BUCKETS
        )
        self.queue = hist(
            "request_queue_time_seconds",
            "Seconds from arrival until the engine first scheduled the request "
            "(held by admission plus queued on the replica).",
            TTFT_BUCKETS,
        )
        self.prompt_tokens = counter(
            "prompt_tokens",
            "Prompt tokens prefilled (counted at each request's first token; an "
            "embedding's when its vector arrives).",
        )
        self.generation_tokens = counter("generation_tokens", "Output tokens streamed.")
        self.embedding_requests = counter(
            "embedding_requests",
            "Embedding inputs answered (one per input of a /v1/embeddings request).",
        )
        self.embedding_tokens = counter(
            "embedding_prompt_tokens", "Prompt tokens of the embedding inputs answered."
        )
        self.success = counter(
            "request_success", "Requests finished, by finish reason.", ("finish_reason",)
        )
        self.aborted = counter("request_aborted", "Requests whose client left before the end.")
        self.rejected = counter(
            "admission_rejections",
            "Requests refused: by admission (429), or, reason queue_timeout, not started "
            "within their queue bound (429, or an error event in an open stream).",
            ("reason",),
        )
        self.slo_met = counter(
            "slo_met_requests",
            "Ended requests that met the SLO named by `slo` (ttft, tpot, or both: goodput).",
            ("slo",),
        )
        self.slo_missed = counter(
            "slo_missed_requests",
            "Ended requests that missed the SLO named by `slo`; refused "
            "and failed requests miss all three.",
            ("slo",),
        )
        self.per_request = (
            self.ttft,
            self.itl,
            self.tpot,
            self.e2e,
            self.queue,
            self.prompt_tokens,
            self.generation_tokens,
            self.embedding_requests,
            self.embedding_tokens,
            self.success,
            self.aborted,
            self.slo_met,
            self.slo_missed,
        )
        # The series a request's ``model`` label falls in (forget_model drops an adapter's).
        self.registry.register(_StateCollector(self))
        # Every class's series exist from the start at 0: a ratio such as missed / (met +
        # missed) has no value for a class while one of its terms has no series.
        for cls in self.slos:
            for metric in (
                self.ttft,
                self.itl,
                self.tpot,
                self.e2e,
                self.queue,
                self.prompt_tokens,
                self.generation_tokens,
                self.embedding_requests,
                self.embedding_tokens,
                self.aborted,
            ):
                metric.labels(model, cls)
            for reason in REJECT_REASONS:
                self.rejected.labels(model, cls, reason)
            for slo in ("ttft", "tpot", "both"):
                self.slo_met.labels(model, cls, slo)
                self.slo_missed.labels(model, cls, slo)

    def request(
        self,
        traffic_class: str,
        arrival_s: float,
        prompt_tokens: int,
        held_s: float = 0.0,
        model: str | None = None,
        embedding: bool = False,
    ) -> RequestRecord:
        """A record for one request (one prompt) sent to a replica after ``held_s``
        seconds held by admission. ``model``: the LoRA adapter it ran with, its series'
        ``model`` label (None: the base model's name); ``embedding``: it is one input of
        an embeddings request."""
        return RequestRecord(
            self, traffic_class, arrival_s, prompt_tokens, held_s, model, embedding
        )

    def forget_model(self, model: str) -> None:
        """Drop every per-request series of adapter ``model`` (unloaded): the ``model``
        label takes only the names served now."""
        for metric in self.per_request:
            for labels in list(metric._metrics):  # noqa: SLF001 - prometheus-client has no
                # public way to list a metric's children; remove() needs their labels.
                if labels[0] == model:
                    metric.remove(*labels)

    def reject(self, traffic_class: str, reason: str) -> None:
        """Count a refusal (one of :data:`REJECT_REASONS`): a missed SLO, as goodput
        counts it."""
        self.rejected.labels(self.model, traffic_class, reason).inc()
        self._outcome(traffic_class, ttft_met=False, tpot_met=False)

    def _outcome(
        self, traffic_class: str, *, ttft_met: bool, tpot_met: bool, model: str | None = None
    ) -> None:
        label = model or self.model
        for slo, met in (("ttft", ttft_met), ("tpot", tpot_met), ("both", ttft_met and tpot_met)):
            (self.slo_met if met else self.slo_missed).labels(label, traffic_class, slo).inc()
        window = self._outcomes.setdefault(traffic_class, deque())
        now = self.clock()
        window.append((now, ttft_met and tpot_met))
        _expire(window, now)  # bounded where nothing scrapes /metrics

    def attainment(self, traffic_class: str) -> float:
        """Share of the class's requests ended in the last minute that met both SLOs
        (NaN when none ended)."""
        window = self._outcomes.get(traffic_class, deque())
        _expire(window, self.clock())
        return sum(met for _, met in window) / len(window) if window else math.nan

    def render(self) -> bytes:
        """The exposition text for ``GET /metrics``."""
        return generate_latest(self.registry)


class _StateCollector:
    """Gauges and replica series computed at scrape time."""

    def __init__(self, m: IngressMetrics) -> None:
        self.m = m

    def describe(self) -> list:
        return []

    def collect(self) -> Iterable:
        m = self.m
        held = GaugeMetricFamily(
            PREFIX + "num_requests_held",
            "Requests held by admission at the ingress now.",
            labels=["model", "traffic_class"],
        )
        counts = m._held()
        for cls in sorted({*m.slos, *counts}):
            held.add_metric([m.model, cls], counts.get(cls, 0))
        att = GaugeMetricFamily(
            PREFIX + "slo_attainment",
            f"Share of requests ended in the last {ATTAINMENT_WINDOW_S:g} s "
            "that met both SLOs (refusals count as misses).",
            labels=["model", "traffic_class"],
        )
        for cls in sorted(m._outcomes):
            att.add_metric([m.model, cls], m.attainment(cls))
        yield held
        yield att
        for name, doc, n in (
            ("num_replicas", "Model replicas running.", m._replicas()),
            ("num_replicas_target", "Model replicas asked for.", m.target_replicas),
            ("start_time_seconds", "When the ingress started (Unix time).", m.started),
        ):
            fam = GaugeMetricFamily(PREFIX + name, doc, labels=["model"])
            fam.add_metric([m.model], n)
            yield fam
        yield from replica_families(m.model, m._replica_stats(), m.slos)


def replica_families(
    model: str, stats: Mapping[str, Mapping[str, Any]], classes: Iterable[str] = ()
) -> list:
    """The replica series from each live replica's routing stats; running and waiting
    for every class in ``classes`` (0 when none), so that an idle replica reads 0."""
    labels = ["model", "replica"]
    running = GaugeMetricFamily(
        PREFIX + "num_requests_running",
        "Requests in the replica's running batch.",
        labels=[*labels, "traffic_class"],
    )
    waiting = GaugeMetricFamily(
        PREFIX + "num_requests_waiting",
        "Requests queued on the replica.",
        labels=[*labels, "traffic_class"],
    )
    kv = GaugeMetricFamily(
        PREFIX + "kv_cache_usage_perc", "KV-cache blocks in use (0-1).", labels=labels
    )
    preempt = CounterMetricFamily(
        PREFIX + "num_preemptions",
        "Requests preempted (KV cache full, or shed for more urgent decodes).",
        labels=labels,
    )
    queries = CounterMetricFamily(
        PREFIX + "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache at admission.",
        labels=labels,
    )
    hits = CounterMetricFamily(
        PREFIX + "prefix_cache_hits",
        "Of those, tokens found cached (their prefill skipped).",
        labels=labels,
    )
    twin = GaugeMetricFamily(
        PREFIX + "step_time_prediction_ratio",
        "The digital twin's drift: predicted / measured step seconds over the last minute, "
        "per step kind (decode, mixed, prefill); 1 is a perfect twin, under 1 steps take "
        "longer than the simulator's model predicts.",
        labels=[*labels, "kind"],
    )
    steps, prefill, decode = [], [], []
    for rid, s in sorted(stats.items()):
        for cls in sorted({*classes, *s.get("running_seqs", {}), *s.get("waiting_requests", {})}):
            running.add_metric([model, rid, cls], s.get("running_seqs", {}).get(cls, 0))
            waiting.add_metric([model, rid, cls], s.get("waiting_requests", {}).get(cls, 0))
        kv.add_metric([model, rid], s.get("kv_usage", 0.0))
        met = s.get("metrics")
        if met:
            preempt.add_metric([model, rid], met["preemptions"])
            queries.add_metric([model, rid], met.get("prefix_cache_queries", 0))
            hits.add_metric([model, rid], met.get("prefix_cache_hits", 0))
            steps.append(([model, rid], met["step_s"]))
            prefill.append(([model, rid, "prefill"], met["prefill_tokens"]))
            decode.append(([model, rid, "decode"], met["decode_tokens"]))
            for kind, p in sorted(met.get("step_time_prediction", {}).items()):
                if p.get("ratio") is not None:
                    twin.add_metric([model, rid, kind], p["ratio"])
    return [
        running,
        waiting,
        kv,
        preempt,
        queries,
        hits,
        twin,
        _histogram("step_time_seconds", "Seconds per engine step.", labels, steps),
        _histogram(
            "iteration_tokens_total",
            "Tokens per engine step, by phase (prefill tokens; decode: one per running sequence).",
            [*labels, "phase"],
            prefill + decode,
        ),
    ]


class RequestRecord:
    """One request's (one prompt's) times at the ingress, recorded as they happen.

    Call :meth:`tokens` as items arrive, then exactly one of :meth:`finished`,
    :meth:`aborted` (client gone), :meth:`failed` or :meth:`refused`; later calls are
    ignored. An embedding input (``embedding``) has no tokens: its prompt tokens count
    when it finishes, as does its TTFT SLO's outcome (its vector is its first result).
    """

    def __init__(
        self,
        m: IngressMetrics,
        traffic_class: str,
        arrival_s: float,
        prompt_tokens: int,
        held_s: float = 0.0,
        model: str | None = None,
        embedding: bool = False,
    ) -> None:
        self.m, self.cls, self.arrival = m, traffic_class, arrival_s
        self.prompt_tokens, self.held_s = prompt_tokens, held_s
        self.embedding = embedding
        self.model = model or m.model
        self.labels = (self.model, traffic_class)
        self.first: float | None = None
        self.last = 0.0
        self.count = 0
        self.reasons: list[str] = []
        self.ended = False

    def scheduled(self, queue_s: float) -> None:
        """``queue_s``: seconds the replica queued the request before its first step
        (recorded with the time it was held at the ingress)."""
        self.m.queue.labels(*self.labels).observe(self.held_s + max(0.0, queue_s))

    def tokens(self, n: int, finish_reasons: Iterable[str] = ()) -> None:
        """``n`` output tokens arrived now (one step's, over all its sequences), and the
        finish reasons of the sequences that ended in that step."""
        self.reasons.extend(finish_reasons)
        if n == 0:
            return
        now = self.m.clock()
        if self.first is None:
            self.first = now
            self.m.ttft.labels(*self.labels).observe(now - self.arrival)
            self.m.prompt_tokens.labels(*self.labels).inc(self.prompt_tokens)
        else:
            self.m.itl.labels(*self.labels).observe(now - self.last)
        self.last = now
        self.count += n
        self.m.generation_tokens.labels(*self.labels).inc(n)

    def finished(self) -> None:
        """Every sequence has ended."""
        if self._end():
            return
        m, labels = self.m, self.labels
        for r in self.reasons or ["unknown"]:
            m.success.labels(*labels, r).inc()
        if self.embedding:
            m.prompt_tokens.labels(*labels).inc(self.prompt_tokens)
            m.embedding_requests.labels(*labels).inc()
            m.embedding_tokens.labels(*labels).inc(self.prompt_tokens)
        now = m.clock()
        m.e2e.labels(*labels).observe(now - self.arrival)
        per_seq = self.count / max(1, len(self.reasons))
        tpot = (self.last - self.first) / (per_seq - 1) if per_seq > 1 else 0.0
        if per_seq > 1:
            m.tpot.labels(*labels).observe(tpot)
        ttft_slo, tpot_slo = m.slos.get(self.cls, (math.inf, math.inf))
        ttft = (self.first if self.first is not None else now) - self.arrival
        ttft_met, tpot_met = ttft <= ttft_slo, tpot <= tpot_slo
        m._outcome(self.cls, ttft_met=ttft_met, tpot_met=tpot_met, model=self.model)
        if m.on_end is not None:
            m.on_end(self.cls, ttft_met and tpot_met, self.count)

    def aborted(self) -> None:
        if not self._end():
            self.m.aborted.labels(*self.labels).inc()

    def failed(self) -> None:
        """Ended by an error after admission (its replica lost): a miss."""
        if not self._end():
            self.m._outcome(self.cls, ttft_met=False, tpot_met=False, model=self.model)
            if self.m.on_end is not None:
                self.m.on_end(self.cls, False, self.count)

    def refused(self) -> None:
        """Refused after it was sent (past its queue bound): counted by the caller with
        :meth:`IngressMetrics.reject`, once per request, so nothing more here."""
        self._end()

    def _end(self) -> bool:
        """Mark ended; True if it already was."""
        was, self.ended = self.ended, True
        return was


def _expire(window: deque[tuple[float, bool]], now: float) -> None:
    """Drop the outcomes older than :data:`ATTAINMENT_WINDOW_S` from ``window``."""
    while window and window[0][0] < now - ATTAINMENT_WINDOW_S:
        window.popleft()
