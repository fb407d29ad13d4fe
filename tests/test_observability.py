"""Metrics end to end: the one-process server (the same ingress, replica and metrics as
on Ray Serve, whose /metrics test_serving.py and test_autoscale_live.py read) under a short
mixed load, scraped by a real Prometheus (Debian's package, installed here when missing)
with the shipped rules; every PromQL expression of the dashboard and the rules returns
data; `iterserve top --once` shows the same figures as `/metrics`."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

pytest.importorskip("ray")

from deploy.config import ServiceConfig  # noqa: E402
from deploy.top import STEP_KINDS, scrape, view  # noqa: E402
from engine.core.step_cost import LinearCost  # noqa: E402
from tests import serving_app as app  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "deploy" / "prometheus" / "rules.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "iterserve.json"
KEYS = {
    "sk-i": {"tenant": "a", "traffic_class": "interactive"},
    "sk-b": {"tenant": "b", "traffic_class": "batch"},
    "sk-t": {"tenant": "c", "traffic_class": "tight"},
}


def _prometheus_binaries() -> tuple[str, str]:
    """``prometheus`` and ``promtool``, from Debian's package when missing (it starts no
    service); skips when they cannot be installed (no root or no package index)."""
    if not (shutil.which("prometheus") and shutil.which("promtool")):
        if not shutil.which("apt-get"):
            pytest.skip("prometheus is not installed and there is no apt-get to install it")
        cmd = ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True)
            r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"prometheus is not installed and apt-get failed: {r.stderr[-300:]}")
    return shutil.which("prometheus"), shutil.which("promtool")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A twin's model from a file, so that the drift's series has data without the
    # replica's own fit (which waits for more steps than the load below runs).
    twin = tmp_path_factory.mktemp("twin") / "cost.json"
    LinearCost((0.02, 1e-4, 1e-3, 0.0, 0.0), 0, 0, 0, 0).save(twin)
    config = ServiceConfig(
        twin_cost_model=str(twin),
        num_replicas=1,
        replica_num_cpus=1,
        port=app.free_port(),
        api_keys=KEYS,
        engine={
            "max_num_seqs": 6,
            "traffic_classes": {
                "interactive": {"ttft_slo_s": 5.0},
                # Out of reach even on an idle replica, and last in priority: while the load
                # holds every seat, admission refuses it (429). (On seats, not on predicted
                # latency alone: admission does not refuse a request for missing an SLO that
                # an idle replica would miss too, unless the load makes it worse, which
                # depends on the step-time fit's slope per decode after a few steps.)
                "tight": {
                    "ttft_slo_s": 0.01,
                    "tpot_slo_s": 0.01,
                    "default_priority": 3,
                    "max_queue_wait_s": 0.3,
                },
            },
        },
    )
    with app.running_local(config) as (url, _):
        yield url


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    binary, _ = _prometheus_binaries()
    d = tmp_path_factory.mktemp("prometheus")
    port = app.free_port()
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "iterserve",
                "static_configs": [{"targets": [server.removeprefix("http://")]}],
            }
        ],
    }
    (d / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={d / 'prometheus.yml'}",
            f"--storage.tsdb.path={d / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(d / "log", "w"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not _scraped(url):  # ready, and a first scrape of the server done
            assert proc.poll() is None and time.monotonic() < deadline, (d / "log").read_text()
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _scraped(url: str) -> bool:
    try:
        r = httpx.get(
            f"{url}/api/v1/query", params={"query": 'up{job="iterserve"} == 1'}, timeout=2
        )
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and bool(r.json()["data"]["result"])


@pytest.fixture(scope="module")
def loaded(server):
    """The server after a short load: two classes, three refusals (class `tight` while the
    load holds every seat) and two aborts."""
    _load(server)
    return server


def _load(url: str) -> None:
    def complete(key: str, tokens: int) -> None:
        httpx.post(
            f"{url}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={
                "model": "SmolLM2-135M-Instruct",
                "prompt": "Once upon a time",
                "max_tokens": tokens,
                "ignore_eos": True,
            },
            timeout=120,
        )

    def abort() -> None:
        body = {
            "model": "SmolLM2-135M-Instruct",
            "prompt": "Tell me a story",
            "max_tokens": 300,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            json=body,
            timeout=120,
            headers={"Authorization": "Bearer sk-i"},
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break  # the client leaves after its first chunk

    # Seven requests for six seats for the first ~3-5 s (the interactive ones' 96 tokens):
    # well past the three `tight` attempts below, however fast the engine decodes (with 48
    # tokens, a faster engine freed a seat before the third attempt).
    jobs = [(complete, ("sk-i", 96))] * 4 + [(complete, ("sk-b", 192))] * 3 + [(abort, ())] * 2
    threads = [threading.Thread(target=f, args=a) for f, a in jobs]
    for t in threads:
        t.start()
    time.sleep(1.0)  # busy now: `tight` requests are refused
    for _ in range(3):
        r = httpx.post(
            f"{url}/v1/completions",
            headers={"Authorization": "Bearer sk-t"},
            json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 429, r.text
    for t in threads:
        t.join(timeout=180)


def _queries() -> list[str]:
    """Every PromQL expression the dashboard and the rules use; for the alert rules, every
    series their conditions read (a condition returns data only while it fires)."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"].replace("$model", ".*") for p in dash["panels"] for t in p["targets"]]
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                exprs += [rule["expr"], rule["record"]]
            else:
                exprs += sorted(
                    set(re.findall(r"\b(?:iterserve:[a-z0-9_:]+|up\{[^}]*\})", rule["expr"]))
                )
    return exprs


def test_shipped_prometheus_files_pass_promtool():
    _, promtool = _prometheus_binaries()
    config = REPO / "deploy" / "prometheus" / "prometheus.yml"
    for args in (["check", "config", str(config)], ["check", "rules", str(RULES)]):
        r = subprocess.run([promtool, *args], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def test_the_twin_drift_alert_fires_after_ten_minutes_outside_its_band(tmp_path):
    _, promtool = _prometheus_binaries()
    series = 'iterserve:step_time_prediction_ratio{model="m",replica="r1",kind="%s"}'

    def alert(kind: str, ratio: str) -> dict:
        return {
            "exp_labels": {"severity": "ticket", "model": "m", "replica": "r1", "kind": kind},
            "exp_annotations": {
                "summary": f"replica r1: the simulator's {kind} step times outside "
                "0.8-1.25 of the measured for 10 minutes",
                "description": f"Predicted / measured step seconds is {ratio} (1: a perfect "
                "twin): `iterserve simulate` runs on a step-time model that no longer "
                "matches this replica. Recalibrate: iterserve calibrate --from-url URL "
                "--output FILE, and set twin_cost_model to FILE.",
            },
        }

    def at(minute: int, *alerts: dict) -> dict:
        return {
            "eval_time": f"{minute}m",
            "alertname": "IterserveTwinDrift",
            "exp_alerts": list(alerts),
        }

    test = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                # Decode steps twice as slow as the twin says, mixed within the band;
                # prefill slow for 9 minutes, then a minute without prefill steps (the
                # replica exports no sample: the series goes stale), then slow again.
                "input_series": [
                    {"series": series % "decode", "values": "0.5x21"},
                    {"series": series % "mixed", "values": "1.2x21"},
                    {"series": series % "prefill", "values": "1.5x8 stale 1.5x11"},
                ],
                "alert_rule_test": [
                    at(9),
                    at(10, alert("decode", "0.50")),
                    at(19, alert("decode", "0.50")),
                    at(20, alert("decode", "0.50"), alert("prefill", "1.50")),
                ],
            }
        ],
    }
    path = tmp_path / "test.yml"
    path.write_text(yaml.safe_dump(test))
    r = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_metrics_under_load_reach_prometheus_and_drain(prometheus, loaded):
    server = loaded
    # Gauges are true with no traffic: every request ended or was aborted.
    deadline = time.monotonic() + 10
    while True:
        now = scrape(server)
        busy = {
            k: v
            for k, v in now.items()
            if v
            and k[0]
            in (
                "iterserve:num_requests_running",
                "iterserve:num_requests_waiting",
                "iterserve:kv_cache_usage_perc",
                "iterserve:num_requests_held",
            )
        }
        if not busy:
            break
        assert time.monotonic() < deadline, busy
        time.sleep(0.5)
    got = {}
    deadline = time.monotonic() + 30
    for expr in _queries():
        while True:
            r = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
            assert r.status_code == 200, (expr, r.text)
            got[expr] = r.json()["data"]["result"]
            if got[expr] or time.monotonic() > deadline:
                break
            time.sleep(1)
    empty = [e for e, res in got.items() if not res]
    assert not empty, f"no data for: {empty}"
    refused = {
        s["metric"]["reason"]
        for s in got[
            'sum by (reason) (rate(iterserve:admission_rejections_total{model=~".*"}[1m]))'
        ]
        if float(s["value"][1]) > 0
    }
    # The first condition each refusal failed: its predicted TTFT or TPOT when the load
    # makes them worse than an idle replica's, else the seats.
    assert refused and refused <= {"ttft", "tpot", "seats"}, refused


def test_top_once_shows_what_metrics_say(loaded):
    server = loaded
    out = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "top", "--url", server, "--once"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "160"},
    )
    assert out.returncode == 0, out.stderr
    v = view(scrape(server), {}, 1.0, True)
    rows = {c.name: c for c in v.classes}
    assert {"interactive", "batch", "tight"} <= set(rows)
    lines = {
        ln.split("│")[1].strip(): ln
        for ln in out.stdout.splitlines()
        if ln.count("│") > 2 and ln.split("│")[1].strip() in rows
    }
    for name, row in rows.items():
        cells = [c.strip() for c in lines[name].split("│")[1:-1]]
        shown = "-" if math.isnan(row.attainment) else f"{100 * row.attainment:.1f}%"
        assert cells[4] == shown, (name, cells)
        assert cells[6] == f"{row.refused:.0f}", (name, cells)
    assert rows["tight"].refused == 3 and rows["tight"].attainment == 0.0
    assert rows["batch"].attainment == 1.0
    assert len(v.replicas) == 1 and v.replicas[0][1:] == (0.0, 0.0, 0.0)
    # The twin's drift per step kind: a ratio, or "-" once the load's steps are over a
    # minute old (the window may empty between the two scrapes).
    assert all(f"twin {k}" in out.stdout for k in STEP_KINDS), out.stdout
    row = next(ln for ln in out.stdout.splitlines() if f"│ {v.replicas[0][0]}" in ln)
    for cell in [c.strip() for c in row.split("│")[1:-1]][-3:]:
        assert cell == "-" or re.fullmatch(r"\d+\.\d\d", cell), row
