"""router.metrics and engine.core.step_metrics without a cluster: what the ingress renders from
requests and replicas."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.step_metrics import StepMetrics
from router.metrics import ATTAINMENT_WINDOW_S, IngressMetrics


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def samples(m: IngressMetrics) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m_samples: dict, name: str, **labels: str) -> float:
    return m_samples[(name, tuple(sorted(labels.items())))]


def step(seconds: float, prefill: int, decodes: int, preempted: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        seconds=seconds,
        num_prefill_tokens=prefill,
        num_decodes=decodes,
        preempted=("x",) * preempted,
    )


def make(clock: Clock, stats: dict | None = None, held: dict | None = None) -> IngressMetrics:
    return IngressMetrics(
        "m",
        {"interactive": (1.0, 0.1), "batch": (60.0, 5.0)},
        lambda: stats or {},
        lambda: held or {},
        lambda: 1,
        2,
        clock=clock,
    )


def test_request_times_tokens_and_slo_outcomes():
    clock = Clock()
    m = make(clock)
    r = m.request("interactive", arrival_s=clock.t, prompt_tokens=7, held_s=0.25)
    clock.t += 0.5
    r.scheduled(0.05)  # queued 0.05 s on the replica after 0.25 s held
    r.tokens(1)
    for i in range(4):
        clock.t += 0.05
        r.tokens(1, ["length"] if i == 3 else [])
    r.finished()
    r.aborted()  # ignored: it already ended
    slow = m.request("interactive", clock.t, 3)
    clock.t += 2.0  # TTFT 2 s: over the 1 s SLO
    slow.tokens(1, ["stop"])
    slow.finished()
    m.reject("interactive", "ttft")
    gone = m.request("batch", clock.t, 5)
    gone.tokens(1)
    gone.aborted()
    s = samples(m)
    lab = dict(model="m", traffic_class="interactive")
    assert value(s, "iterserve:time_to_first_token_seconds_count", **lab) == 2
    assert value(s, "iterserve:time_to_first_token_seconds_sum", **lab) == pytest.approx(2.5)
    assert value(s, "iterserve:request_queue_time_seconds_sum", **lab) == pytest.approx(0.3)
    # TPOT: 4 gaps of 0.05 s between 5 tokens.
    assert value(s, "iterserve:request_time_per_output_token_seconds_sum", **lab) == pytest.approx(
        0.05
    )
    assert value(s, "iterserve:inter_token_latency_seconds_count", **lab) == 4
    assert value(s, "iterserve:generation_tokens_total", **lab) == 6
    assert value(s, "iterserve:prompt_tokens_total", **lab) == 10
    assert value(s, "iterserve:request_success_total", **lab, finish_reason="length") == 1
    assert value(s, "iterserve:request_success_total", **lab, finish_reason="stop") == 1
    assert value(s, "iterserve:admission_rejections_total", **lab, reason="ttft") == 1
    assert value(s, "iterserve:request_aborted_total", model="m", traffic_class="batch") == 1
    # One met both SLOs; the slow one missed TTFT; the refused one missed both.
    assert value(s, "iterserve:slo_met_requests_total", **lab, slo="both") == 1
    assert value(s, "iterserve:slo_missed_requests_total", **lab, slo="both") == 2
    assert value(s, "iterserve:slo_met_requests_total", **lab, slo="tpot") == 2
    assert value(s, "iterserve:slo_missed_requests_total", **lab, slo="ttft") == 2
    assert value(s, "iterserve:slo_attainment", **lab) == pytest.approx(1 / 3)
    # The aborted request has no SLO outcome, and the rolling window forgets.
    assert math.isnan(value(s, "iterserve:slo_attainment", model="m", traffic_class="batch"))
    clock.t += 61
    assert math.isnan(value(samples(m), "iterserve:slo_attainment", **lab))


def test_replica_series_come_from_routing_stats_and_gauges_track_them():
    steps = StepMetrics()
    steps.record(step(0.04, 0, 8))
    steps.record(step(0.2, 300, 8, preempted=2))
    stats = {
        "r1": {
            "running_seqs": {"interactive": 3},
            "waiting_requests": {"batch": 2},
            "kv_usage": 0.5,
            "metrics": {
                **steps.to_dict(),
                "prefix_cache_queries": 900,
                "prefix_cache_hits": 640,
                "step_time_prediction": {
                    "decode": {"ratio": 0.5, "steps": 120},
                    "mixed": {"ratio": 1.1, "steps": 4},
                    "prefill": {"ratio": None, "steps": 0},
                },
            },
        }
    }
    m = make(Clock(), stats, held={"interactive": 4})
    s = samples(m)
    rep = dict(model="m", replica="r1")
    assert value(s, "iterserve:num_requests_running", **rep, traffic_class="interactive") == 3
    assert value(s, "iterserve:num_requests_waiting", **rep, traffic_class="batch") == 2
    assert value(s, "iterserve:num_requests_running", **rep, traffic_class="batch") == 0
    assert value(s, "iterserve:kv_cache_usage_perc", **rep) == 0.5
    assert value(s, "iterserve:num_preemptions_total", **rep) == 2
    assert value(s, "iterserve:prefix_cache_queries_total", **rep) == 900
    assert value(s, "iterserve:prefix_cache_hits_total", **rep) == 640
    assert value(s, "iterserve:step_time_seconds_count", **rep) == 2
    assert value(s, "iterserve:step_time_seconds_bucket", **rep, le="0.05") == 1
    assert value(s, "iterserve:iteration_tokens_total_sum", **rep, phase="prefill") == 300
    assert value(s, "iterserve:iteration_tokens_total_count", **rep, phase="decode") == 2
    ratio = "iterserve:step_time_prediction_ratio"
    assert value(s, ratio, **rep, kind="decode") == 0.5
    assert value(s, ratio, **rep, kind="mixed") == 1.1
    assert not [k for k in s if k[0] == ratio and ("kind", "prefill") in k[1]]  # no steps
    assert value(s, "iterserve:num_requests_held", model="m", traffic_class="interactive") == 4
    assert value(s, "iterserve:num_requests_held", model="m", traffic_class="batch") == 0
    assert value(s, "iterserve:num_replicas", model="m") == 1
    assert value(s, "iterserve:num_replicas_target", model="m") == 2
    # Drained: the next stats say 0, and so do the gauges.
    stats["r1"].update(running_seqs={}, waiting_requests={}, kv_usage=0.0)
    s = samples(m)
    assert value(s, "iterserve:num_requests_running", **rep, traffic_class="interactive") == 0
    assert value(s, "iterserve:num_requests_waiting", **rep, traffic_class="batch") == 0
    assert value(s, "iterserve:kv_cache_usage_perc", **rep) == 0.0


def test_the_attainment_window_stays_bounded_unscraped():
    """Outcomes older than the window are dropped as new ones arrive, whether or not
    anything reads ``/metrics``."""
    clock = Clock()
    m = make(clock)
    for _ in range(1000):
        clock.t += 1.0
        m.reject("interactive", "ttft")
    assert len(m._outcomes["interactive"]) <= ATTAINMENT_WINDOW_S + 1
