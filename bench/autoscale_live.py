"""Autoscaling live on this machine: a load step on ``iterserve serve --num-replicas auto``
(1 to 2 replicas of 1 CPU), beside a fixed single replica on the same requests.

    python -m bench.autoscale_live           # about 15 minutes (printed first)

1. Calibrate: the fixed single replica serves 8 closed-loop clients for ``CALIBRATE_S``;
   its throughput is this host's capacity of one replica now.
2. The same open-loop schedule (Poisson arrivals, seeded) goes to each system in turn,
   fixed first: ``LIGHT`` of that capacity for a minute, ``STEP`` of it (more than one
   replica holds) for ``STEP_S``, then ``LIGHT`` again until the autoscaled fleet is back
   to one replica (at most ``TAIL_S``).
3. Every request is judged against the ``standard`` class's SLOs; a 429 must carry
   Retry-After and counts as a miss; a stream must end with ``[DONE]``. ``/health`` is
   polled every second for the running and target replica counts, and the server's
   ``iterserve.autoscale`` log lines give each decision with its reason.

Writes ``bench/results/autoscale_live.json`` and ``autoscale_live.md``.
"""

from __future__ import annotations

import asyncio
import random
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.toolkit import cli
from bench.toolkit import report as rp
from bench.toolkit.prompts import corpus_text
from bench.toolkit.servers import MODEL_NAME, Server, SystemSpec, model_dir
from policies import DEFAULT_CLASSES

CORPUS = corpus_text()

CALIBRATE_S = 40.0
LIGHT, STEP = 0.3, 1.6
"""Arrival rates, as multiples of one replica's calibrated throughput."""
LIGHT_S, STEP_S, TAIL_S = 60.0, 150.0, 180.0
MAX_TOKENS = 48
PROMPT_CHARS = 900
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "decision_period_s": 2.0,
    "window_s": 10.0,
    "scale_down_delay_s": 45.0,
    "replica_start_s": 15.0,
}


def _spec(auto: bool) -> SystemSpec:
    """The autoscaled fleet, or the fixed single replica: the same Ray Serve deployment
    (num_replicas 1 alone would serve in process), pinned at one replica."""
    bounds = AUTOSCALING if auto else {**AUTOSCALING, "max_replicas": 1}
    label = "autoscaled 1..2" if auto else "fixed 1"
    return SystemSpec(label, "iterserve", service={"replica_num_cpus": 1, "autoscaling": bounds})


def _body(i: int) -> dict:
    start = (i * 7919) % (len(CORPUS) - PROMPT_CHARS)
    return {
        "model": MODEL_NAME,
        "prompt": CORPUS[start : start + PROMPT_CHARS],
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "ignore_eos": True,
    }


async def _one(c: httpx.AsyncClient, url: str, i: int, t0: float) -> dict[str, Any]:
    sent = time.monotonic()
    rec: dict[str, Any] = {"i": i, "t": sent - t0}
    try:
        async with c.stream("POST", f"{url}/v1/completions", json=_body(i)) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                await r.aread()
                rec["retry_after"] = r.headers.get("retry-after")
                return rec
            rec["replica"] = r.headers.get("x-iterserve-replica")
            times, last = [], ""
            async for line in r.aiter_lines():
                if not line:
                    continue
                last = line
                if line.startswith("data: {"):
                    times.append(time.monotonic())
            rec["done"] = last == "data: [DONE]"
            rec["ttft_s"] = times[0] - sent if times else None
            rec["tpot_s"] = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    except httpx.HTTPError as e:
        rec["status"] = f"{type(e).__name__}: {e}"
    return rec


async def _open_loop(url: str, arrivals: list[float]) -> list[dict[str, Any]]:
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=300) as c:
        tasks = []
        for i, at in enumerate(arrivals):
            await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
            tasks.append(asyncio.create_task(_one(c, url, i, t0)))
        return list(await asyncio.gather(*tasks))


async def _calibrate(url: str) -> float:
    t0 = time.monotonic()
    done = 0

    async def client(k: int) -> None:
        nonlocal done
        async with httpx.AsyncClient(timeout=300) as c:
            n = 0
            while time.monotonic() - t0 < CALIBRATE_S:
                rec = await _one(c, url, k * 1000 + n, t0)
                n += 1
                done += rec.get("status") == 200

    await asyncio.gather(*(client(k) for k in range(8)))
    return done / (time.monotonic() - t0)


def schedule(capacity_rps: float, seed: int) -> tuple[list[float], float]:
    """Poisson arrival times (s) of the light-step-light load, and when the step ends."""
    rng = random.Random(seed)
    out, t = [], 0.0
    phases = ((LIGHT, LIGHT_S), (STEP, LIGHT_S + STEP_S), (LIGHT, LIGHT_S + STEP_S + TAIL_S))
    for k, until in phases:
        while True:
            t += rng.expovariate(k * capacity_rps)
            if t >= until:
                t = until
                break
            out.append(t)
    return out, LIGHT_S + STEP_S


class Poller:
    """``/health`` every second: ``(s since start, running replicas, target)``."""

    def __init__(self, url: str) -> None:
        self.url, self.samples = url, []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                h = httpx.get(f"{self.url}/health", timeout=5).json()
            except (httpx.HTTPError, ValueError):
                continue
            target = (h.get("autoscaling") or {}).get("target", h.get("num_replicas"))
            self.samples.append((round(time.monotonic() - self._t0, 1), h["num_replicas"], target))

    def stop(self) -> list:
        self._stop.set()
        self._thread.join()
        return self.samples


def judge(records: list[dict], step: tuple[float, float]) -> dict[str, Any]:
    """Per phase (before, during, after the step) and overall: requests, 200s, 429s,
    other failures, attainment of the ``standard`` SLOs (a 429 is a miss)."""
    cls = DEFAULT_CLASSES["standard"]

    def met(r: dict) -> bool:
        return (
            r.get("status") == 200
            and r.get("done")
            and r["ttft_s"] is not None
            and r["ttft_s"] <= cls.ttft_slo_s
            and r["tpot_s"] <= cls.tpot_slo_s
        )

    def summary(rs: list[dict]) -> dict[str, Any]:
        ok = [r for r in rs if r.get("status") == 200]
        ttft = sorted(r["ttft_s"] for r in ok if r.get("ttft_s") is not None)
        return {
            "requests": len(rs),
            "ok": len(ok),
            "refused_429": sum(r.get("status") == 429 for r in rs),
            "refused_without_retry_after": sum(
                r.get("status") == 429 and not r.get("retry_after") for r in rs
            ),
            "broken_or_failed": sum(
                (r.get("status") == 200 and not r.get("done")) or r.get("status") not in (200, 429)
                for r in rs
            ),
            "attainment": sum(met(r) for r in rs) / len(rs) if rs else None,
            "ttft_p50_s": rp.percentile(ttft, 50),
            "ttft_p99_s": rp.percentile(ttft, 99),
        }

    a, b = step
    return {
        "before": summary([r for r in records if r["t"] < a]),
        "step": summary([r for r in records if a <= r["t"] < b]),
        "after": summary([r for r in records if r["t"] >= b]),
        "all": summary(records),
    }


def run_system(auto: bool, arrivals: list[float] | None, seed: int) -> dict[str, Any]:
    spec = _spec(auto)
    slo = (DEFAULT_CLASSES["standard"].ttft_slo_s, DEFAULT_CLASSES["standard"].tpot_slo_s)
    with Server(spec, model_dir(), mix=False, slo=slo) as server:
        url = server.url
        out: dict[str, Any] = {"system": spec.label}
        if arrivals is None:
            out["capacity_rps"] = asyncio.run(_calibrate(url))
            return out
        poller = Poller(url)
        records = asyncio.run(_open_loop(url, arrivals))
        if auto:  # the tail: until the fleet is back to one replica
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not (
                poller.samples and poller.samples[-1][1:] == (1, 1)
            ):
                time.sleep(1)
        out["timeline"] = poller.stop()
        out["records"] = records
        out["decisions"] = [
            re.sub(r"^.*?(\d\d:\d\d:\d\d)[,.]\d+.*?iterserve\.autoscale:? ", r"\1 ", line)
            for line in server.log.read_text().splitlines()
            if "iterserve.autoscale" in line and "target" in line
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("bench.autoscale_live", __doc__)
    cli.add_seed(p)
    cli.add_out(p, "bench/results", "the folder of the result files")
    args = p.parse_args(argv)
    cli.expected("autoscale_live", CALIBRATE_S + 2 * (LIGHT_S + STEP_S + TAIL_S) + 4 * 60)
    t0 = time.perf_counter()
    capacity = run_system(False, None, args.seed)["capacity_rps"]
    arrivals, step_end = schedule(capacity, args.seed)
    print(f"one replica: {capacity:.2f} req/s; {len(arrivals)} requests", flush=True)
    systems = [run_system(auto, arrivals, args.seed) for auto in (False, True)]
    for s in systems:
        s["judged"] = judge(s.pop("records"), (LIGHT_S, step_end))
    auto = systems[1]
    up = next((t for t, n, _ in auto["timeline"] if n >= 2), None)
    down = next(
        (t for t, n, tg in auto["timeline"] if up is not None and t > up and n == 1 and tg == 1),
        None,
    )
    report = {
        "run": rp.run_record(),  # the markdown quotes it
        "capacity_rps": capacity,
        "rates_rps": {"light": LIGHT * capacity, "step": STEP * capacity},
        "phases_s": {"light": LIGHT_S, "step": STEP_S, "tail_max": TAIL_S},
        "autoscaling": AUTOSCALING,
        "second_replica_serving_at_s": up,
        "back_to_one_at_s": down,
        "systems": systems,
        "wall_s": time.perf_counter() - t0,
    }
    rp.write_report(Path(args.out) / "autoscale_live.json", report, markdown(report))
    return 0


def markdown(rep: dict[str, Any]) -> str:
    head = [
        "system",
        "phase",
        "requests",
        "200",
        "429",
        "broken/failed",
        "attainment",
        "TTFT p50 / p99 (s)",
    ]
    rows = []
    for s in rep["systems"]:
        for phase in ("before", "step", "after", "all"):
            j = s["judged"][phase]
            rows.append(
                [
                    s["system"],
                    phase,
                    str(j["requests"]),
                    str(j["ok"]),
                    str(j["refused_429"]),
                    str(j["broken_or_failed"]),
                    rp.pct(j["attainment"]),
                    f"{rp.fmt(j['ttft_p50_s'])} / {rp.fmt(j['ttft_p99_s'])}",
                ]
            )
    auto = rep["systems"][1]
    lines = [
        "# Autoscaling live: a load step, 1 to 2 replicas",
        "",
        f"Run: {rep['run']['date']}, commit {rep['run']['commit']}, {rep['run']['host']}: "
        f"`{rep['run']['command']}` ({rep['wall_s'] / 60:.1f} min).",
        "",
        f"One replica (1 CPU) served {rep['capacity_rps']:.2f} req/s closed-loop. Load: "
        f"{rep['rates_rps']['light']:.2f} req/s for {rep['phases_s']['light']:.0f} s, "
        f"{rep['rates_rps']['step']:.2f} req/s for {rep['phases_s']['step']:.0f} s, then "
        f"{rep['rates_rps']['light']:.2f} req/s; the `standard` class's SLOs. Autoscaling: "
        + ", ".join(f"{k} {v:g}" for k, v in rep["autoscaling"].items())
        + ".",
        "",
        f"The second replica served from {rep['second_replica_serving_at_s']} s (the step "
        f"began at {rep['phases_s']['light']:.0f} s); the fleet was back to one replica at "
        f"{rep['back_to_one_at_s']} s.",
        "",
        rp.table(head, rows),
        "",
        "Decisions (the server's `iterserve.autoscale` log):",
        "",
        "```",
        *auto["decisions"],
        "```",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
