"""``iterserve top``: a live terminal view of each class's SLOs, read from ``/metrics``.

Every refresh scrapes the server's ``/metrics`` and compares it with the scrape nearest to
a minute before (the first frames, and ``--once``, compare with the server's start: every
counter from zero). Per class: request rate, TTFT and TPOT p50/p99 (interpolated in the
histogram buckets, as Prometheus's ``histogram_quantile`` does), SLO attainment (both SLOs
met; refusals count as misses), goodput, refusals; the replicas running and asked for
(with autoscaling, the autoscaler's last decision); per replica: running, waiting, KV use,
and the digital twin's drift per step kind (``iterserve:step_time_prediction_ratio``: the
simulator's predicted step seconds / the measured, over the replica's last minute; "-"
where the replica ran no step of the kind). Drawn with ``rich``.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from router.metrics import PREFIX

WINDOW_S = 60.0
STEP_KINDS = ("decode", "mixed", "prefill")
"""The step kinds of ``iterserve:step_time_prediction_ratio`` (``engine.core.step_log``'s)."""

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""One scrape: ``{(sample name, sorted labels): value}``."""


def scrape(url: str, timeout_s: float = 5.0) -> Samples:
    """``url``'s ``/metrics``, parsed.

    Raises:
        httpx.HTTPError: the server did not answer 200.
    """
    r = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s)
    r.raise_for_status()
    out: Samples = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def totals(samples: Samples, names: Iterable[str]) -> dict[str, float]:
    """Each of ``names`` (full sample names, ``iterserve:...``) summed over its labels; 0
    for a name with no sample."""
    out = dict.fromkeys(names, 0.0)
    for (n, _), v in samples.items():
        if n in out:
            out[n] += v
    return out


def _by(samples: Samples, name: str, key: str, **match: str) -> dict[str, float]:
    """Sum of ``name``'s samples by label ``key``, over those matching ``match``."""
    out: dict[str, float] = defaultdict(float)
    for (n, labels), v in samples.items():
        d = dict(labels)
        if n == PREFIX + name and all(d.get(k) == x for k, x in match.items()):
            out[d.get(key, "")] += v
    return out


def quantile(q: float, buckets: dict[float, float]) -> float:
    """``q`` of a cumulative histogram ``{upper bound: count}`` (NaN when empty), linear
    within a bucket, as Prometheus's ``histogram_quantile``."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return math.nan
    rank, prev_bound, prev_count = q * buckets[bounds[-1]], 0.0, 0.0
    for b in bounds:
        if buckets[b] >= rank:
            if math.isinf(b):
                return prev_bound
            width = buckets[b] - prev_count
            return prev_bound + (b - prev_bound) * ((rank - prev_count) / width if width else 1)
        prev_bound, prev_count = b, buckets[b]
    return prev_bound


def _histogram(now: Samples, then: Samples, name: str, cls: str) -> dict[float, float]:
    out: dict[float, float] = defaultdict(float)
    for (n, labels), v in now.items():
        d = dict(labels)
        if n == PREFIX + name + "_bucket" and d.get("traffic_class") == cls:
            out[float(d["le"])] += v - then.get((n, labels), 0.0)
    return out


@dataclass
class ClassRow:
    name: str
    rate: float
    ttft: tuple[float, float]
    tpot: tuple[float, float]
    attainment: float
    goodput: float
    refused: float


@dataclass
class View:
    window_s: float
    since_start: bool
    classes: list[ClassRow] = field(default_factory=list)
    replicas: list[tuple[str, float, float, float]] = field(default_factory=list)
    """(replica, running, waiting, KV usage 0-1)."""
    twin: dict[str, dict[str, float]] = field(default_factory=dict)
    """``{replica: {step kind: predicted / measured step seconds}}``, kinds with a ratio."""
    fleet: tuple[float, float] = (math.nan, math.nan)
    """Replicas running and asked for (with autoscaling: its last decision); NaN: unknown."""


def view(now: Samples, then: Samples, window_s: float, since_start: bool) -> View:
    """The figures shown, from two scrapes ``window_s`` apart (``then`` empty: since start)."""

    def delta(name: str, key: str, **match: str) -> dict[str, float]:
        a, b = _by(now, name, key, **match), _by(then, name, key, **match)
        return {k: a[k] - b.get(k, 0.0) for k in a}

    out = View(window_s, since_start)
    met = delta("slo_met_requests_total", "traffic_class", slo="both")
    missed = delta("slo_missed_requests_total", "traffic_class", slo="both")
    refused = delta("admission_rejections_total", "traffic_class")
    ended = delta("e2e_request_latency_seconds_count", "traffic_class")
    for cls in sorted({*met, *missed}):
        total = met.get(cls, 0.0) + missed.get(cls, 0.0)
        ttft = _histogram(now, then, "time_to_first_token_seconds", cls)
        tpot = _histogram(now, then, "request_time_per_output_token_seconds", cls)
        out.classes.append(
            ClassRow(
                cls,
                (ended.get(cls, 0.0) + refused.get(cls, 0.0)) / window_s,
                (quantile(0.5, ttft), quantile(0.99, ttft)),
                (quantile(0.5, tpot), quantile(0.99, tpot)),
                met.get(cls, 0.0) / total if total else math.nan,
                met.get(cls, 0.0) / window_s,
                refused.get(cls, 0.0),
            )
        )
    running = _by(now, "num_requests_running", "replica")
    waiting = _by(now, "num_requests_waiting", "replica")
    kv = _by(now, "kv_cache_usage_perc", "replica")
    out.replicas = [
        (r, running.get(r, 0.0), waiting.get(r, 0.0), kv.get(r, 0.0))
        for r in sorted({*running, *kv})
    ]
    running, target = (_by(now, n, "model") for n in ("num_replicas", "num_replicas_target"))
    out.fleet = (
        sum(running.values()) if running else math.nan,
        sum(target.values()) if target else math.nan,
    )
    for (n, labels), v in now.items():
        d = dict(labels)
        if n == PREFIX + "step_time_prediction_ratio" and "replica" in d and "kind" in d:
            out.twin.setdefault(d["replica"], {})[d["kind"]] = v
    return out


def _f(x: float, spec: str) -> str:
    return "-" if math.isnan(x) else format(x, spec)


def render(v: View, url: str) -> Group:
    span = "since the server started" if v.since_start else f"last {v.window_s:.0f} s"
    classes = Table(title=f"iterserve at {url}: traffic classes, {span}", expand=True)
    for col in (
        "class",
        "req/s",
        "TTFT p50 / p99 s",
        "TPOT p50 / p99 s",
        "SLO attainment",
        "goodput req/s",
        "refused",
    ):
        classes.add_column(col, justify="left" if col == "class" else "right")
    for c in v.classes:
        classes.add_row(
            c.name,
            _f(c.rate, ".2f"),
            f"{_f(c.ttft[0], '.2f')} / {_f(c.ttft[1], '.2f')}",
            f"{_f(c.tpot[0], '.3f')} / {_f(c.tpot[1], '.3f')}",
            "-" if math.isnan(c.attainment) else f"{100 * c.attainment:.1f}%",
            _f(c.goodput, ".2f"),
            f"{c.refused:.0f}",
        )
    running, target = v.fleet
    fleet = "" if math.isnan(target) else f": {running:.0f} running, {target:.0f} asked for"
    replicas = Table(title=f"replicas, now{fleet}", expand=True)
    twin_cols = [f"twin {k}" for k in STEP_KINDS]
    for col in ("replica", "running", "waiting", "KV cache", *twin_cols):
        replicas.add_column(col, justify="left" if col == "replica" else "right")
    for r, running, waiting, kv in v.replicas:
        ratios = v.twin.get(r, {})
        replicas.add_row(
            r,
            f"{running:.0f}",
            f"{waiting:.0f}",
            f"{100 * kv:.1f}%",
            *(_f(ratios.get(k, math.nan), ".2f") for k in STEP_KINDS),
        )
    if v.twin:
        replicas.caption = (
            "twin: the simulator's predicted / measured step seconds, last minute "
            "(1: a perfect twin; alert outside 0.8-1.25)"
        )
    return Group(classes, replicas)


def run(url: str, *, once: bool = False, interval_s: float = 2.0) -> int:
    """Draw until Ctrl-C (or once).

    Raises:
        httpx.HTTPError: the first scrape failed.
    """
    history: deque[tuple[float, Samples]] = deque()
    start = time.monotonic()

    def frame() -> Group:
        now_t, now = time.monotonic(), scrape(url)
        history.append((now_t, now))
        while len(history) > 1 and history[1][0] <= now_t - WINDOW_S:
            history.popleft()
        then_t, then = history[0]
        if then_t <= now_t - WINDOW_S:
            return render(view(now, then, now_t - then_t, False), url)
        return render(view(now, {}, max(1e-9, _uptime(now) or now_t - start), True), url)

    if once:
        Console().print(frame())
        return 0
    with Live(frame(), refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(interval_s)
                live.update(frame())
        except KeyboardInterrupt:
            return 0


def _uptime(samples: Samples) -> float:
    """Seconds since the ingress started (``iterserve:start_time_seconds``); 0 if absent."""
    for (name, _), v in samples.items():
        if name == PREFIX + "start_time_seconds":
            return max(0.0, time.time() - v)
    return 0.0
