"""Scheduling benchmark: static vs continuous batching, chunked prefill, priority, admission.

Run from the repository root::

    .venv/bin/python bench/scheduling.py            # full run (about 80 min on 2 CPU cores)
    .venv/bin/python bench/scheduling.py --quick    # smoke run (2 loads x 3 configs, ~3 min)

Workload
    Azure LLM inference trace 2023, conversation service
    (``../shared/traces/azure_llm_2023_conv.csv`` relative to the repository root; columns
    TIMESTAMP, ContextTokens, GeneratedTokens; CC-BY 4.0, published with Splitwise, Patel et al.,
    ISCA 2024). Window: the trace rows from ``--window-start`` (default 0, i.e. from
    2023-11-16 18:15:46) onward, as many as the highest load needs. Each point replays the window
    in real time through the in-process ``AsyncLLMEngine``: at a target rate R for ``--duration``
    D seconds it takes the window's first N = round(R * D) requests and scales their trace
    timestamps by one factor (``time_scale``) so that request N + 1 would arrive at exactly D;
    request i arrives at ``(TIMESTAMP_i - TIMESTAMP_0) * time_scale``. Offered load is varied only
    by that factor: every load replays the same real inter-arrival pattern (bursts included),
    stretched or squeezed, and offers exactly N / D requests per second (the trace's first
    seconds are lighter than its 5.5 req/s mean, so scaling by the mean rate would under-offer).
    The rows, timestamps and each point's ``time_scale`` are printed and saved. Lengths are
    scaled down to fit a 2-core CPU: prompt = round(ContextTokens / 8) clamped to [4, 1024],
    output = round(GeneratedTokens / 8) clamped to [2, 128] (``--prompt-scale``, ...; no row
    among the first 2000 is clamped). Why 8: less scaling is more faithful, and the lengths
    decide what static batching costs, since a request that arrives mid-batch waits out the
    batch's remaining decode steps, in seconds against the 2 s TTFT SLO. The trace's outputs
    average 265 tokens over its first 2000 rows. Divided by 16 (first 200 rows: about 15
    tokens of about 0.1 s each here), a static batch's decode mostly ends within the SLO;
    divided by 8, it takes about 3 s. 8 is the smallest power of two at which a full run
    fits a working session (about 80 min; /4 would double it) on 2 cores with as many
    requests per point as a /16 run at 25 s: halving the lengths halves capacity, so
    ``--duration`` (50 s) is doubled. Both divisors are equal, so the prompt-to-output ratio
    (about 4:1) is the trace's. The priority experiment divides both by
    ``--priority-scale`` (16) instead, with its own capacity measured at that scale: its
    target is the TTFT that scheduling adds beside batch traffic, and at /8 the window's
    longest interactive prompts (trace rows 3006, 3007, 3009, 3015: 2468-4106 tokens, so
    308-513 at /8) miss the 2 s SLO on an idle replica here (its interactive-alone runs'
    p99 TTFT was 2.27 s at 0.05x and 2.69 s at 0.1x in the full run at /8 of commit
    75f2d65): that floor is the CPU's prefill speed (1.9-2.6 ms a token in the step-model
    fits of that run and 4c876ce's), not a scheduler's choice. At /16 they are 154-257
    tokens.
    Prompts are token ids drawn uniformly from [1000, 40000) by ``random.Random(seed)`` in row
    order (deterministic, identical across configs and loads); each request is forced to produce
    exactly its output length (``ignore_eos=True``, ``max_tokens`` = scaled GeneratedTokens,
    greedy). Classes: each row is interactive with probability 0.7 and batch otherwise
    (``random.Random(seed + 1)``, per row, so a request keeps its class at every load); SLOs are
    ``policies.DEFAULT_CLASSES`` (interactive TTFT 2 s / TPOT 0.5 s, batch 60 s / 5 s).

Capacity and loads
    Loads are multiples of a capacity estimated first: a closed loop of ``--capacity-concurrency``
    (12) clients replaying the same window's requests back to back for ``--capacity-duration``
    seconds on the cont-chunk-fixed engine (raw throughput, without the guard's TPOT caps);
    capacity = (completed requests + the completed fraction of the in-flight ones) / duration,
    in requests per second. The admission
    controller's fitted step-time model gives a second, SLO-based estimate
    (``(1 - a / TPOT_slo) / (b * mean_prompt + c * mean_output)``: the rate at which the steady
    step time reaches the interactive TPOT SLO), printed for comparison. ``--capacity R`` skips
    the measurement. Default loads: 0.25, 0.5, 1, 1.5, 2 x capacity; a config that misses 90%
    attainment even at its lowest load gets one more point at half that load
    (``--extra-low-points``), so that its goodput is bracketed. The grid is coarse where goodput
    usually lies (0.5x to 1x), so each config's bracket (the last load that passes, the first
    that fails) is then halved ``--goodput-refine`` times (2) by a point at its midpoint.

Systems (one engine per config, reused across its loads, warmed up first; fp32 on CPU)
    static          policy="static" (Orca's request-level baseline), no chunked prefill
    cont-nochunk    continuous batching, FCFS, enable_chunked_prefill=False
    cont-chunk      continuous batching, FCFS, chunked prefill (budget --chunk-budget, 128)
                    with the TPOT SLO guard at 0.85 of the SLO, as the server runs it
                    (``--no-tpot-guard``): under FCFS it sheds nothing and only sizes each
                    step's prefill, from the running decodes' TPOT SLOs and the banked
                    TPOT credit (Sarathi-Serve's SLO-derived token budget, per step), and
                    lets a prompt owed its TTFT borrow beyond that
    cont-chunk-fixed  the same without the guard: every step with prefill queued fills the
                    fixed budget, and a full step here takes about the TPOT SLO
    priority        continuous + chunked, policy="priority" (aging 10 s/level) with the TPOT
                    SLO guard, which here also sheds less urgent decodes
    cont-chunk+adm  cont-chunk behind admission control: admission decides who enters,
                    the guard how long each step is
    priority+adm    priority, with admission control in front
    The chunked budget follows Sarathi-Serve's rule (a full step should fit the TPOT SLO): on
    this CPU a prefill token costs ~2-5 ms and a small decode step ~0.2-0.3 s, so 128 tokens
    keep a full step near the interactive TPOT SLO of 0.5 s (the engine default, 512, costs
    ~1-2.5 s a step here; the chunk experiment compares budgets). Without chunking the step
    budget is --nochunk-budget (2048, at least the longest prompt): the engine never schedules
    a prompt longer than the budget when chunking is off (vLLM sets it to max_model_len). Shared:
    max_num_seqs 64, 1024 KV blocks of 16 tokens. Admission "on" emulates the router: before
    ``generate`` it asks ``admission_decision`` with the request's class; Admit: go; Wait: sleep
    min(max_wait_s, 0.25 s) and ask again with waited_s updated; Reject: the request is counted
    as rejected (the HTTP layer's 429). For every request sent to a non-static engine the
    controller's ``predict`` is recorded at that moment and compared with the TTFT measured from
    then (``policies.PredictionLog``).

Metrics (per class and over all requests)
    TTFT = first token time - scheduled arrival (held time included); TPOT = (finish - first
    token) / (n_tokens - 1). SLO attainment: TTFT and TPOT both within the class SLOs; of offered
    (rejected and cut-off requests count as missed) and among admitted. A point ends
    ``--drain`` seconds after its last arrival at most; requests still unfinished then are
    aborted ("cut off") and count as missed (the table says how many could still have met their
    SLO). The default, 40 s, lets an interactive request that arrives last finish: the longest
    output among the first 420 rows is 82 tokens at /8, and decodes run at about 0.4 s a token
    under load here (the TPOT SLO is 0.5 s), so it ends about 35 s after arriving. At 15 s,
    admitted interactive requests still decoding within their TPOT SLO were cut off and counted
    as missed. Throughput: output tokens / point wall time. SLO goodput rate: requests meeting
    their SLOs / duration. Goodput (DistServe, Zhong et al., OSDI 2024): the highest offered rate at
    which >= 90% of requests meet both SLOs, over each config's load sweep (linear interpolation
    between the last load that passes and the first that fails, after the refinement above).

Targeted experiments (``--experiments``)
    chunk      4 interactive decoders (prompts of trace rows 0-3) reach steady state, then a
               long prompt (1024 tokens, max_tokens 1) arrives, twice, 10 decode tokens apart;
               inter-token gaps (ITL) of the decoders that overlap the long prompt's prefill
               (arrival to first token), with chunking off and at budgets 512 (engine
               default), 128, 64, 32 and 16 (``--chunk-variants``). The target's "TPOT of running
               decodes while a long prompt arrives" is each decoder's mean gap over the
               prefill windows; its p99 over the decoders is compared with the steady TPOT,
               the mean gap with no prefill in flight. The p99 of single gaps (ITL) over
               steady ITL p50 is reported beside it: a stricter view with no target. The
               whole-request TPOT, which dilutes a stall over the output, is reported too.
    admission  from the sweep at the highest load (2x): attainment of admitted interactive
               requests and SLO goodput rate vs the peak over loads, admission on vs off.
    priority   lengths / ``--priority-scale`` (16; capacity measured at that scale):
               batch traffic alone at 2x capacity (open loop, trace arrivals, 45 s), then the
               same plus interactive traffic at 0.05x and 0.1x capacity (requests; trace rows
               from 3000), under FCFS (once) and under priority (``--priority-repeats``, 3):
               interactive p99 TTFT over the pooled priority runs vs its SLO, and batch
               output throughput (tokens produced within the duration) vs batch alone:
               batch-alone runs bracket each repeat's mixed runs, each mixed run is divided
               by the mean of the two around it (so that the host's drift cancels), and the
               median over repeats is reported. Each interactive stream also runs alone,
               once: its p99 TTFT there is the floor no scheduler beats beside batch
               traffic. The interactive stream's share of the replica's work (its prompt and
               output tokens per second over capacity's) is reported: batch cannot keep
               more than the rest of capacity, so the batch target is judged only at loads
               whose share is at most 10% (``PRIORITY_BATCH_MAX_WORK_SHARE``).

Output
    A markdown report on stdout, ``bench/results/scheduling.json`` (``scheduling_quick.json``
    with --quick), PNG plots beside it (``<stem>_goodput.png``, ``<stem>_cdf.png``,
    ``<stem>_chunk.png``). Targets are printed beside the measurements, never asserted.
    Timings are wall clock on a shared machine: ``other load`` is the average number of cores
    other processes kept busy during each point.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cpu_load import cpu_snapshot, foreign_cores

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
RESULTS = REPO / "bench" / "results"
ATTRIBUTION = (
    "Azure LLM inference trace 2023 (conversation), CC-BY 4.0, from Splitwise: Patel, Choukse, "
    "Zhang, Shah, Goiri, Maleki, Bianchini, ISCA 2024 (Azure/AzurePublicDataset)"
)
TOKEN_ID_RANGE = (1000, 40000)
GOODPUT_ATTAINMENT = 0.90
WAIT_POLL_S = 0.25

CONFIGS: dict[str, dict[str, Any]] = {
    "static": {"policy": "static", "chunked": False, "admission": False, "guard": False,
               "desc": "static batching (request-level), no chunked prefill"},
    "cont-nochunk": {"policy": "fcfs", "chunked": False, "admission": False, "guard": False,
                     "desc": "continuous batching, FCFS, no chunked prefill"},
    "cont-chunk": {"policy": "fcfs", "chunked": True, "admission": False, "guard": True,
                   "desc": "continuous batching, FCFS, chunked prefill, each step's prefill "
                           "sized by the TPOT SLO guard"},
    "cont-chunk-fixed": {"policy": "fcfs", "chunked": True, "admission": False,
                         "guard": False,
                         "desc": "continuous batching, FCFS, chunked prefill at the fixed "
                                 "token budget"},
    "priority": {"policy": "priority", "chunked": True, "admission": False, "guard": True,
                 "desc": "continuous + chunked, priority policy with aging, TPOT SLO guard"},
    "cont-chunk+adm": {"policy": "fcfs", "chunked": True, "admission": True, "guard": True,
                       "desc": "cont-chunk behind SLO-aware admission"},
    "priority+adm": {"policy": "priority", "chunked": True, "admission": True, "guard": True,
                     "desc": "priority behind SLO-aware admission"},
}
QUICK_CONFIGS = ("static", "cont-chunk", "cont-chunk+adm")
EXPERIMENTS = ("chunk", "admission", "priority")

TARGETS = {
    "goodput_cont_chunk_over_static": 3.0,
    "chunk_stall_p99_over_steady": 1.5,
    "admission_admitted_interactive_attainment": 0.99,
    "admission_goodput_frac_of_peak": 0.90,
    "priority_interactive_p99_ttft_within_slo": 1.0,
    "priority_batch_tput_frac_of_alone": 0.80,
}
PRIORITY_BATCH_MAX_WORK_SHARE = 0.10
"""The batch-throughput target is judged at interactive loads whose work share (see
``exp_priority``) is at most this: there an ideal scheduler leaves batch at least 90% of
what it gets alone, so the 80% bar measures what scheduling costs. At a larger share the
bar measures the share itself (at 18%, batch could keep 82% at most); those loads are
reported, with their ceiling, but not judged."""


# ------------------------------------------------------------------------------------------
# Workload
# ------------------------------------------------------------------------------------------


def _parse_ts(s: str) -> float:
    """Seconds since midnight of a TIMESTAMP like '2023-11-16 18:15:46.6805900' (one day)."""
    date, clock = s.strip().split(" ")
    h, m, sec = clock.split(":")
    return int(h) * 3600 + int(m) * 60 + float(sec)


@dataclass(slots=True)
class TraceRequest:
    row: int
    offset_s: float
    """Trace seconds since the window's first row."""
    timestamp: str
    context_tokens: int
    generated_tokens: int
    prompt_ids: list[int]
    max_tokens: int
    cls: str


class Workload:
    """The trace window, with scaled lengths, deterministic prompts and classes per row."""

    def __init__(self, args: argparse.Namespace) -> None:
        import csv

        self.args = args
        with open(args.trace, newline="") as f:
            rows = list(csv.DictReader(f))
        rows = rows[args.window_start:]
        if len(rows) < 2:
            raise SystemExit("trace window is empty")
        t0 = _parse_ts(rows[0]["TIMESTAMP"])
        id_rng = random.Random(args.seed)
        cls_rng = random.Random(args.seed + 1)
        self.requests: list[TraceRequest] = []
        for i, r in enumerate(rows):
            ctx, gen = int(r["ContextTokens"]), int(r["GeneratedTokens"])
            p = min(max(args.min_prompt, round(ctx / args.prompt_scale)), args.max_prompt)
            o = min(max(args.min_output, round(gen / args.output_scale)), args.max_output)
            cls = "interactive" if cls_rng.random() < args.interactive_frac else "batch"
            ids = [id_rng.randrange(*TOKEN_ID_RANGE) for _ in range(p)]
            self.requests.append(TraceRequest(args.window_start + i,
                                              _parse_ts(r["TIMESTAMP"]) - t0, r["TIMESTAMP"],
                                              ctx, gen, ids, o, cls))
            if i >= args.max_window_rows:
                break
        # The trace's own mean rate over the first rows (for the report only).
        n = min(len(self.requests), args.rate_rows)
        self.trace_rate = (n - 1) / self.requests[n - 1].offset_s
        self.max_row_used = 0

    def window(self, rate: float, duration: float, start: int = 0,
               cls: str | None = None) -> tuple[list[tuple[float, TraceRequest]], float]:
        """The N = round(rate * duration) requests from index ``start``, arrivals in seconds.

        Their trace times are scaled so that request N + 1 would arrive at exactly
        ``duration``: the offered rate is N / duration and the real inter-arrival pattern
        is kept (stretched or squeezed). Returns ((arrival_s, request) pairs, time_scale).
        """
        n = max(1, round(rate * duration))
        if start + n >= len(self.requests):
            raise SystemExit(f"the trace window has {len(self.requests)} rows; {rate} req/s "
                             f"for {duration} s needs {start + n + 1}: raise --max-window-rows")
        base = self.requests[start].offset_s
        span = self.requests[start + n].offset_s - base
        scale = duration / span if span > 0 else 1.0
        out = []
        for r in self.requests[start:start + n]:
            if cls is not None and r.cls != cls:
                r = TraceRequest(r.row, r.offset_s, r.timestamp, r.context_tokens,
                                 r.generated_tokens, r.prompt_ids, r.max_tokens, cls)
            out.append(((r.offset_s - base) * scale, r))
        self.max_row_used = max(self.max_row_used, self.requests[start + n - 1].row)
        return out, scale

    def scaling(self) -> str:
        """How the trace's lengths were scaled, for the report."""
        a = self.args
        return (f"prompt = round(ContextTokens / {a.prompt_scale:g}) clamped to "
                f"[{a.min_prompt}, {a.max_prompt}], output = round(GeneratedTokens "
                f"/ {a.output_scale:g}) clamped to [{a.min_output}, {a.max_output}]; "
                f"prompt ids uniform in [{TOKEN_ID_RANGE[0]}, {TOKEN_ID_RANGE[1]}) "
                f"(random.Random({a.seed})); ignore_eos, greedy")

    def mean_lengths(self, n: int) -> tuple[float, float]:
        rs = self.requests[:n]
        return (statistics.fmean(len(r.prompt_ids) for r in rs),
                statistics.fmean(r.max_tokens for r in rs))


# ------------------------------------------------------------------------------------------
# Measurement helpers
# ------------------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float | None:
    """q-th percentile (0-100) with linear interpolation; None when empty."""
    xs = sorted(x for x in xs if x is not None and not math.isnan(x))
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


# ------------------------------------------------------------------------------------------
# Engine lifecycle
# ------------------------------------------------------------------------------------------


def engine_config_kwargs(name: str, args: argparse.Namespace) -> dict[str, Any]:
    c = CONFIGS[name]
    return engine_kwargs(args, policy=c["policy"], chunked=c["chunked"], guard=c["guard"])


def engine_kwargs(args: argparse.Namespace, policy: str, chunked: bool, guard: bool,
                  budget: int | None = None) -> dict[str, Any]:
    if budget is None:
        budget = args.chunk_budget if chunked else args.nochunk_budget
    return {
        "policy": policy,
        "enable_chunked_prefill": chunked,
        "max_num_batched_tokens": budget,
        "max_num_seqs": args.max_num_seqs,
        "num_kv_blocks": args.num_kv_blocks,
        "block_size": 16,
        "seed": args.seed,
        "tpot_slo_guard": guard and not args.no_tpot_guard,
        **({"tpot_slo_guard_target": args.tpot_guard_target}
           if guard and args.tpot_guard_target is not None else {}),
    }


class StepLog:
    """``--step-log PATH``: one JSON line per engine step, to read why a request missed.

    Fields: ``t`` (monotonic seconds at the step's start, the clock of the records'
    arrival and token times), ``dur_s`` (its wall time), ``pred_s`` (the step-time model's
    prediction for its shape times the model's local ratio, as the TPOT guard sees it),
    ``decodes``, ``prefill_tokens``, ``waiting`` and ``running`` (after the step),
    ``cap`` and ``owed`` (the guard's prefill caps in tokens; None: no cap), ``deferred``
    (decodes that sat the step out), ``preempted`` (request ids) and ``seqs`` (``[request
    id, position of its first token scheduled, tokens]`` per scheduled sequence; ids carry
    the config, the load and the trace row).
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", buffering=1)

    def attach(self, engine) -> None:
        """Log every step of ``engine`` (an ``LLMEngine``) from now on."""
        engine.on_step = self.write

    def write(self, r) -> None:
        """Append one ``engine.StepRecord`` as a JSON line."""
        self.file.write(json.dumps(_finite({
            "t": r.start, "dur_s": r.seconds, "pred_s": r.predicted_s,
            "decodes": r.num_decodes, "prefill_tokens": r.num_prefill_tokens,
            "waiting": r.num_waiting, "running": r.num_running,
            "cap": r.prefill_cap, "owed": r.owed_cap, "deferred": len(r.sat_out),
            "preempted": list(r.preempted), "seqs": [list(s) for s in r.seqs],
        })) + "\n")


async def start_engine(kwargs: dict[str, Any], args: argparse.Namespace):
    from engine.async_engine import AsyncLLMEngine
    from engine.config import EngineConfig

    loop = asyncio.get_running_loop()
    t = time.perf_counter()
    aeng = await loop.run_in_executor(None, AsyncLLMEngine.from_config, EngineConfig(**kwargs))
    if args.step_log is not None:
        StepLog(args.step_log).attach(aeng.engine)
    # Warm-up: a few small requests (kernels, allocator, and the step-time model's first fit).
    rng = random.Random(12345)
    warm = [([rng.randrange(*TOKEN_ID_RANGE) for _ in range(n)], m)
            for n, m in ((16, 6), (48, 6), (160, 4), (24, 6))]
    await asyncio.gather(*(_drain_one(aeng, ids, m, f"warm-{i}")
                           for i, (ids, m) in enumerate(warm)))
    return aeng, time.perf_counter() - t


async def _drain_one(aeng, ids: list[int], max_tokens: int, rid: str,
                     cls: str = "interactive") -> None:
    from engine.request import RequestOutputKind, SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    async for _ in aeng.generate({"prompt_token_ids": ids}, sp, request_id=rid,
                                 traffic_class=cls):
        pass


async def stop_engine(aeng) -> None:
    await aeng.shutdown()
    gc.collect()


async def wait_idle(aeng, timeout: float = 30.0) -> dict[str, Any]:
    """Wait for aborts to land; report leftovers and the KV block accounting."""
    eng = aeng.engine
    bm = eng.block_manager
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (not eng.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks
                and aeng.num_unfinished == 0):
            break
        await asyncio.sleep(0.05)
    check_error = None
    try:
        bm.check()
    except AssertionError as e:
        check_error = f"BlockManager.check failed: {e}"
    return {
        "blocks_free": bm.num_free_blocks,
        "blocks_total": bm.num_blocks,
        "blocks_ok": bm.num_free_blocks == bm.num_blocks and check_error is None,
        "engine_unfinished": eng.has_unfinished_requests(),
        "streams_open": aeng.num_unfinished,
        "check_error": check_error,
        "engine_error": repr(aeng._error) if getattr(aeng, "_error", None) else None,
    }


# ------------------------------------------------------------------------------------------
# One client: admission (optional), generate, record
# ------------------------------------------------------------------------------------------


async def client(aeng, req: TraceRequest, arrival: float, rec: dict[str, Any], *,
                 admission: bool, predict: bool, record_tokens: bool) -> None:
    """Send one request at ``arrival`` (monotonic s) and record what happened in ``rec``."""
    try:
        await _client(aeng, req, arrival, rec, admission=admission, predict=predict,
                      record_tokens=record_tokens)
    except asyncio.CancelledError:
        if rec["status"] in ("pending", "running"):
            rec["status"] = "cut_off"
            rec["cut_time"] = time.monotonic()
        raise


async def _client(aeng, req: TraceRequest, arrival: float, rec: dict[str, Any], *,
                  admission: bool, predict: bool, record_tokens: bool) -> None:
    from engine.request import RequestOutputKind, SamplingParams
    from policies import Admit, Reject

    now = time.monotonic()
    if arrival > now:
        await asyncio.sleep(arrival - now)
    rec["late_s"] = time.monotonic() - arrival
    plen, mt, cls = len(req.prompt_ids), req.max_tokens, req.cls
    if admission:
        holds = 0
        while True:
            waited = time.monotonic() - arrival
            d = aeng.admission_decision(plen, mt, cls, waited_s=waited)
            if isinstance(d, Admit):
                break
            if isinstance(d, Reject):
                rec.update(status="rejected", reject_reason=d.reason,
                           retry_after_s=d.retry_after_s, holds=holds, held_s=waited)
                return
            holds += 1
            rec["holds"] = holds
            await asyncio.sleep(max(0.0, min(d.max_wait_s, WAIT_POLL_S)))
        rec["holds"] = holds
    admit = time.monotonic()
    rec["held_s"] = admit - arrival
    rec["admit_time"] = admit
    if predict:
        try:
            p = aeng.admission.predict(aeng.load_snapshot(), cls, plen)
            rec["pred_ttft_s"] = p.ttft_s
            rec["pred_tpot_s"] = p.tpot_s
        except Exception as e:  # noqa: BLE001 - the benchmark reports it, keeps going
            rec["pred_error"] = repr(e)
    sp = SamplingParams(max_tokens=mt, temperature=0, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA)
    rec["status"] = "running"
    times: list[float] = []
    rec["n_tokens"] = 0
    if record_tokens:
        rec["token_times"] = times
    last = None
    try:
        async for out in aeng.generate({"prompt_token_ids": req.prompt_ids}, sp,
                                       request_id=rec["id"], traffic_class=cls):
            t = time.monotonic()
            k = len(out.outputs[0].token_ids)
            times.extend([t] * k)
            rec["n_tokens"] += k
            if rec.get("first_seen") is None and k:
                rec["first_seen"] = t
            last = out
    except asyncio.CancelledError:
        if last is not None:
            rec["first_token_time"] = last.metrics.first_token_time
        raise
    except Exception as e:  # noqa: BLE001 - an engine error is a result here
        rec["status"] = "error"
        rec["error"] = repr(e)
        return
    if last is None:
        rec["status"] = "error"
        rec["error"] = "stream ended without output"
        return
    m = last.metrics
    rec.update(status="finished", first_token_time=m.first_token_time,
               finish_time=m.finish_time, engine_arrival=m.arrival_time,
               n_tokens=rec["n_tokens"],
               finish_reason=last.outputs[0].finish_reason)


def new_record(i: int, req: TraceRequest, arrival: float, tag: str) -> dict[str, Any]:
    return {"id": f"{tag}-{i}-r{req.row}", "row": req.row, "cls": req.cls, "arrival": arrival,
            "prompt_len": len(req.prompt_ids), "max_tokens": req.max_tokens,
            "status": "pending"}


async def run_open_loop(aeng, schedule: list[tuple[float, TraceRequest]], *, admission: bool,
                        predict: bool, duration: float, drain: float, tag: str,
                        record_tokens: bool = False,
                        drain_only: set[str] | None = None) -> tuple[list[dict], dict]:
    """Replay ``schedule`` (offsets in s) from now; cut off ``drain`` s after ``duration``.

    ``drain_only``: classes whose requests are waited for after ``duration``; the others are
    cut off as soon as those are done (None: wait for all).
    """
    t0 = time.monotonic() + 0.2
    recs = [new_record(i, r, t0 + a, tag) for i, (a, r) in enumerate(schedule)]
    tasks = [asyncio.create_task(client(aeng, r, rec["arrival"], rec, admission=admission,
                                        predict=predict, record_tokens=record_tokens))
             for rec, (_, r) in zip(recs, schedule)]
    preempt0 = aeng.engine.scheduler.num_preemptions
    cpu0 = cpu_snapshot()
    cutoff = t0 + duration + drain
    waited = [t for t, rec in zip(tasks, recs)
              if drain_only is None or rec["cls"] in drain_only]
    if waited:
        await asyncio.wait(waited, timeout=max(0.0, cutoff - time.monotonic()))
    if drain_only is not None or not waited:
        # Requests not waited for run at least until the end of the arrivals.
        await asyncio.sleep(max(0.0, t0 + duration - time.monotonic()))
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    t_end = time.monotonic()
    wall = t_end - t0
    cpu1 = cpu_snapshot()
    idle = await wait_idle(aeng)
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            idle.setdefault("client_exceptions", []).append(repr(t.exception()))
    info = {"t0": t0, "t_end": t_end, "wall_s": wall, "cut_off": len(pending),
            "preemptions": aeng.engine.scheduler.num_preemptions - preempt0,
            "foreign_cores": foreign_cores(cpu0, cpu1, wall), **idle}
    return recs, info


# ------------------------------------------------------------------------------------------
# Summaries
# ------------------------------------------------------------------------------------------


def classify(rec: dict, slo, end_time: float) -> dict:
    """Add ttft/tpot/attained to ``rec``; returns it."""
    st = rec["status"]
    rec["ttft_s"] = rec["tpot_s"] = None
    rec["ttft_censored"] = False
    rec["attained"] = False
    rec["undetermined"] = False
    ft = rec.get("first_token_time")
    if st == "finished":
        rec["ttft_s"] = ft - rec["arrival"]
        n = rec["n_tokens"]
        if n >= 2:
            rec["tpot_s"] = (rec["finish_time"] - ft) / (n - 1)
        rec["attained"] = (rec["ttft_s"] <= slo.ttft_slo_s
                           and (rec["tpot_s"] is None or rec["tpot_s"] <= slo.tpot_slo_s))
        if rec.get("admit_time") is not None:
            rec["actual_ttft_from_admit_s"] = ft - rec["admit_time"]
    elif st == "cut_off" or st == "pending":
        cut = rec.get("cut_time", end_time)
        if ft is None:
            rec["ttft_s"] = cut - rec["arrival"]
            rec["ttft_censored"] = True
            could = rec["ttft_s"] <= slo.ttft_slo_s
        else:
            rec["ttft_s"] = ft - rec["arrival"]
            n_left = rec["max_tokens"] - 1
            lower_tpot = (cut - ft) / n_left if n_left > 0 else 0.0
            could = rec["ttft_s"] <= slo.ttft_slo_s and lower_tpot <= slo.tpot_slo_s
        rec["undetermined"] = could
    return rec


def summarize(recs: list[dict], classes, duration: float, wall: float, end_time: float,
              names: tuple[str, ...] = ("interactive", "batch")) -> dict[str, Any]:
    for rec in recs:
        classify(rec, classes[rec["cls"]], end_time)
    out: dict[str, Any] = {}
    for name in (*names, "all"):
        rs = [r for r in recs if name == "all" or r["cls"] == name]
        offered = len(rs)
        rejected = sum(r["status"] == "rejected" for r in rs)
        admitted = offered - rejected
        finished = [r for r in rs if r["status"] == "finished"]
        met = sum(r["attained"] for r in rs)
        ttfts = [r["ttft_s"] for r in rs if r["ttft_s"] is not None]
        tpots = [r["tpot_s"] for r in finished if r["tpot_s"] is not None]
        out[name] = {
            "offered": offered,
            "rejected": rejected,
            "admitted": admitted,
            "finished": len(finished),
            "cut_off": sum(r["status"] == "cut_off" for r in rs),
            "cut_off_could_meet": sum(r["undetermined"] for r in rs),
            "errors": sum(r["status"] == "error" for r in rs),
            "wrong_length": sum(r["n_tokens"] != r["max_tokens"] for r in finished),
            "met": met,
            "attainment_offered": met / offered if offered else None,
            "attainment_admitted": met / admitted if admitted else None,
            "ttft_p50_s": pct(ttfts, 50),
            "ttft_p99_s": pct(ttfts, 99),
            "ttft_censored": sum(r["ttft_censored"] for r in rs),
            "tpot_p50_s": pct(tpots, 50),
            "tpot_p99_s": pct(tpots, 99),
            "held_p50_s": pct([r.get("held_s") for r in rs if r.get("held_s") is not None], 50),
            "output_tokens": sum(r.get("n_tokens", 0) for r in rs),
            "output_tok_s": sum(r.get("n_tokens", 0) for r in rs) / wall if wall > 0 else None,
            "goodput_rate": met / duration,
        }
    return out


def prediction_summary(recs: list[dict]) -> dict[str, Any] | None:
    from policies import PredictionLog

    log = PredictionLog(maxlen=None)
    signed, per_cls = [], {}
    for r in recs:
        if r.get("pred_ttft_s") is None or r.get("actual_ttft_from_admit_s") is None:
            continue
        p, a = r["pred_ttft_s"], r["actual_ttft_from_admit_s"]
        log.record(p, a)
        signed.append(p - a)
        per_cls.setdefault(r["cls"], PredictionLog(maxlen=None)).record(p, a)
    if not len(log):
        return None
    s = log.summary()
    s["count"] = int(s["count"])
    s["mean_signed_error_s"] = statistics.fmean(signed)
    s["p90_abs_error_s"] = pct([abs(x) for x in signed], 90)
    s["by_class"] = {k: {**v.summary(), "count": len(v)} for k, v in per_cls.items()}
    return s


def goodput(points: list[dict]) -> dict[str, Any]:
    """DistServe goodput: highest offered rate with >= 90% of requests meeting both SLOs."""
    pts = sorted(points, key=lambda p: p["rate_offered"])
    last_ok = None
    for p in pts:
        att = p["summary"]["all"]["attainment_offered"]
        if att is None:
            continue
        if att >= GOODPUT_ATTAINMENT:
            last_ok = p
            continue
        if last_ok is None:
            return {"goodput_rps": 0.0, "bound": "below_lowest_load",
                    "lowest_rate": p["rate_offered"], "grid_rps": 0.0}
        a0 = last_ok["summary"]["all"]["attainment_offered"]
        r0, r1 = last_ok["rate_offered"], p["rate_offered"]
        g = r0 + (r1 - r0) * (a0 - GOODPUT_ATTAINMENT) / (a0 - att) if a0 > att else r0
        return {"goodput_rps": g, "bound": "interpolated", "grid_rps": r0,
                "bracket_load_x": [last_ok["load_x"], p["load_x"]]}
    if last_ok is None:
        return {"goodput_rps": None, "bound": "no_points", "grid_rps": None}
    return {"goodput_rps": last_ok["rate_offered"], "bound": "at_least_highest_load",
            "grid_rps": last_ok["rate_offered"]}


# ------------------------------------------------------------------------------------------
# Capacity
# ------------------------------------------------------------------------------------------


async def measure_capacity(wl: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """Closed loop of C clients on cont-chunk-fixed (raw throughput, without the TPOT guard's
    prefill caps); returns req/s and the step-model estimate."""
    from engine.request import RequestOutputKind, SamplingParams
    from policies import DEFAULT_CLASSES

    aeng, load_s = await start_engine(engine_config_kwargs("cont-chunk-fixed", args), args)
    nxt = iter(range(10**9))
    done_reqs, tokens, partial = 0, 0, 0.0
    t_end = time.monotonic() + args.capacity_duration
    ttfts: list[float] = []

    async def loop_client(c: int) -> None:
        nonlocal done_reqs, tokens, partial
        while time.monotonic() < t_end:
            i = next(nxt)
            r = wl.requests[i % args.capacity_rows]
            sp = SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
            n = 0
            start = time.monotonic()
            try:
                async for out in aeng.generate({"prompt_token_ids": r.prompt_ids}, sp,
                                               request_id=f"cap-{i}",
                                               traffic_class="interactive"):
                    k = len(out.outputs[0].token_ids)
                    if n == 0 and k:
                        ttfts.append(time.monotonic() - start)
                    n += k
                    tokens += k
            except asyncio.CancelledError:
                partial += n / r.max_tokens
                raise
            done_reqs += 1

    cpu0 = cpu_snapshot()
    t0 = time.monotonic()
    tasks = [asyncio.create_task(loop_client(c)) for c in range(args.capacity_concurrency)]
    await asyncio.sleep(max(0.0, t_end - time.monotonic()))
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    wall = time.monotonic() - t0
    foreign = foreign_cores(cpu0, cpu_snapshot(), wall)
    idle = await wait_idle(aeng)
    coef = aeng.engine.step_time_model.coefficients()
    await stop_engine(aeng)
    a, b, c = coef
    p_mean, o_mean = wl.mean_lengths(args.capacity_rows)
    slo = DEFAULT_CLASSES["interactive"].tpot_slo_s
    denom = b * p_mean + c * o_mean
    model_rps = (1 - a / slo) / denom if denom > 0 and a < slo else None
    return {
        "method": f"closed loop, {args.capacity_concurrency} clients, cont-chunk-fixed engine, "
                  f"{args.capacity_duration:.0f} s, requests = first {args.capacity_rows} "
                  "window rows cycled",
        "measured_rps": (done_reqs + partial) / wall,
        "completed": done_reqs,
        "partial_equiv": partial,
        "output_tok_s": tokens / wall,
        "ttft_p50_s": pct(ttfts, 50),
        "wall_s": wall,
        "engine_load_s": load_s,
        "foreign_cores": foreign,
        "step_coefficients": list(coef),
        "mean_prompt": p_mean,
        "mean_output": o_mean,
        "model_slo_rps": model_rps,
        "model_formula": "(1 - a / TPOT_slo_interactive) / (b * mean_prompt + c * mean_output)",
        **{k: v for k, v in idle.items() if k in ("blocks_ok", "engine_error")},
    }


# ------------------------------------------------------------------------------------------
# Load sweep
# ------------------------------------------------------------------------------------------


async def run_sweep(wl: Workload, args: argparse.Namespace, capacity: float,
                    loads: list[float], configs: list[str]) -> dict[str, Any]:
    from policies import DEFAULT_CLASSES

    results: dict[str, Any] = {}
    for name in configs:
        cfg = CONFIGS[name]
        kwargs = engine_config_kwargs(name, args)
        aeng, load_s = await start_engine(kwargs, args)
        print(f"[{name}] engine ready ({load_s:.1f} s with warm-up): {kwargs}", flush=True)
        classes = aeng.engine.traffic_classes or DEFAULT_CLASSES
        points = []
        todo = list(loads)
        extra, refine = args.extra_low_points, args.goodput_refine
        while todo:
            x = todo.pop(0)
            rate = x * capacity
            sched, scale = wl.window(rate, args.duration)
            recs, info = await run_open_loop(
                aeng, sched, admission=cfg["admission"], predict=cfg["policy"] != "static",
                duration=args.duration, drain=args.drain, tag=f"{name}-{x:g}")
            summ = summarize(recs, classes, args.duration, info["wall_s"], info["t_end"])
            point = {
                "load_x": x,
                "rate_nominal": rate,
                "rate_offered": len(sched) / args.duration,
                "time_scale": scale,
                "rows": [sched[0][1].row, sched[-1][1].row] if sched else None,
                "summary": summ,
                "prediction": prediction_summary(recs),
                "rejections_sample": sorted({r.get("reject_reason", "").split(";")[0]
                                             for r in recs if r["status"] == "rejected"})[:3],
                **{k: v for k, v in info.items() if k not in ("t0", "t_end")},
                "records": [_compact(r) for r in recs],
            }
            points.append(point)
            a, i = summ["all"], summ["interactive"]
            print(f"[{name}] load {x:g}x ({rate:.2f} req/s, {len(sched)} req): attain "
                  f"{_pct(a['attainment_offered'])} (int {_pct(i['attainment_offered'])}), "
                  f"rej {a['rejected']}, cut {a['cut_off']}, int TTFT p99 "
                  f"{_f(i['ttft_p99_s'])} s, TPOT p99 {_f(i['tpot_p99_s'], '.3f')} s, "
                  f"{_f(a['output_tok_s'], '.1f')} tok/s, wall {info['wall_s']:.0f} s, "
                  f"other load {_f(info['foreign_cores'])}"
                  + ("" if info["blocks_ok"] else f"  BLOCKS LEAKED {info}"), flush=True)
            if not info["blocks_ok"] or info["engine_error"]:
                print(f"[{name}] engine left in a bad state; restarting it", flush=True)
                await stop_engine(aeng)
                aeng, _ = await start_engine(kwargs, args)
            if not todo and extra > 0:
                # Goodput needs a load that passes: below the lowest one, halve it.
                low = min(points, key=lambda p: p["load_x"])
                att = low["summary"]["all"]["attainment_offered"]
                if att is not None and att < GOODPUT_ATTAINMENT:
                    extra -= 1
                    todo.append(low["load_x"] / 2)
                    print(f"[{name}] attainment {_pct(att)} < 90% at the lowest load "
                          f"{low['load_x']:g}x: adding {low['load_x'] / 2:g}x", flush=True)
            if not todo and refine > 0:
                g = goodput(points)
                if g["bound"] == "interpolated":
                    refine -= 1
                    x0, x1 = g["bracket_load_x"]
                    todo.append((x0 + x1) / 2)
                    print(f"[{name}] goodput between {x0:g}x and {x1:g}x: adding "
                          f"{(x0 + x1) / 2:g}x", flush=True)
        points.sort(key=lambda p: p["load_x"])
        await stop_engine(aeng)
        del aeng
        results[name] = {"config": kwargs, "admission": cfg["admission"], "desc": cfg["desc"],
                         "points": points, "goodput": goodput(points)}
    return results


def _compact(r: dict) -> dict:
    keep = ("row", "cls", "status", "prompt_len", "max_tokens", "n_tokens", "ttft_s", "tpot_s",
            "attained", "held_s", "holds", "pred_ttft_s", "actual_ttft_from_admit_s",
            "late_s", "ttft_censored", "error")
    return {k: (_r(r[k]) if isinstance(r.get(k), float) else r[k]) for k in keep if k in r}


# ------------------------------------------------------------------------------------------
# Experiment 1: a long prompt arrives while requests decode
# ------------------------------------------------------------------------------------------


async def exp_chunk(wl: Workload, args: argparse.Namespace) -> dict[str, Any]:
    variants = []
    for v in args.chunk_variants.split(","):
        v = v.strip()
        if v == "off":
            variants.append(("no-chunk", False, max(args.nochunk_budget, args.long_prompt)))
        elif v:
            variants.append((f"chunk-{int(v)}", True, int(v)))
    k = args.decoders
    min_budget = min([b for _, c, b in variants if c] or [args.long_prompt])
    stall_steps = math.ceil(args.long_prompt / max(1, min_budget - k))
    steady_tokens = 14
    max_tokens = steady_tokens + stall_steps * args.long_repeats + 12 * args.long_repeats + 4
    rng = random.Random(args.seed + 7)
    long_prompts = [[rng.randrange(*TOKEN_ID_RANGE) for _ in range(args.long_prompt)]
                    for _ in range(args.long_repeats)]
    decoders = [wl.requests[i] for i in range(k)]
    out: dict[str, Any] = {"long_prompt_tokens": args.long_prompt, "decoders": k,
                           "decoder_prompt_lens": [len(r.prompt_ids) for r in decoders],
                           "decoder_max_tokens": max_tokens, "repeats": args.long_repeats,
                           "variants": {}}
    for vname, chunked, budget in variants:
        kwargs = engine_kwargs(args, "fcfs", chunked, False, budget)
        aeng, _ = await start_engine(kwargs, args)
        recs = [new_record(i, r, 0.0, f"dec-{vname}") for i, r in enumerate(decoders)]
        for rec, r in zip(recs, decoders):
            rec["max_tokens"] = max_tokens
            r2 = TraceRequest(r.row, 0, r.timestamp, 0, 0, r.prompt_ids, max_tokens,
                              "interactive")
            rec["task"] = asyncio.create_task(
                client(aeng, r2, time.monotonic(), rec, admission=False, predict=False,
                       record_tokens=True))
        windows = []
        cpu0, t_start = cpu_snapshot(), time.monotonic()
        err = None
        try:
            target = steady_tokens
            for j, lp in enumerate(long_prompts):
                deadline = time.monotonic() + 120
                while (min(rec["n_tokens"] if "n_tokens" in rec else 0 for rec in recs) < target
                       and time.monotonic() < deadline):
                    await asyncio.sleep(0.01)
                t_sub = time.monotonic()
                lrec = {"id": f"long-{vname}-{j}", "n_tokens": 0}
                lreq = TraceRequest(-1, 0, "", len(lp), 1, lp, 1, "interactive")
                await client(aeng, lreq, t_sub, lrec, admission=False, predict=False,
                             record_tokens=True)
                t_first = lrec.get("first_token_time") or time.monotonic()
                windows.append((t_sub, t_first))
                target = min(rec["n_tokens"] for rec in recs) + 10
            await asyncio.wait_for(asyncio.gather(*(rec["task"] for rec in recs)), 300)
        except Exception as e:  # noqa: BLE001
            err = repr(e)
            for rec in recs:
                rec["task"].cancel()
            await asyncio.gather(*(rec["task"] for rec in recs), return_exceptions=True)
        wall = time.monotonic() - t_start
        foreign = foreign_cores(cpu0, cpu_snapshot(), wall)
        idle = await wait_idle(aeng)
        await stop_engine(aeng)
        del aeng
        during, steady, per_dec_during_mean = [], [], []
        for rec in recs:
            ts = rec.get("token_times", [])
            mine = []
            for i in range(2, len(ts)):  # skip the first gaps (ramp-up)
                a, b = ts[i - 1], ts[i]
                if any(a < w1 and b > w0 for w0, w1 in windows):
                    during.append(b - a)
                    mine.append(b - a)
                elif all(b <= w0 or a >= w1 + 0.05 for w0, w1 in windows):
                    steady.append(b - a)
            if mine:
                per_dec_during_mean.append(statistics.fmean(mine))
        steady_med = pct(steady, 50)
        p99_during = pct(during, 99)
        steady_tpot = statistics.fmean(steady) if steady else None
        tpot_p99_during = pct(per_dec_during_mean, 99)
        res = {
            "engine": kwargs,
            "long_prefill_s": [w1 - w0 for w0, w1 in windows],
            "steady_itl_p50_s": steady_med,
            "steady_itl_p99_s": pct(steady, 99),
            "during_itl_p50_s": pct(during, 50),
            "during_itl_p99_s": p99_during,
            "during_itl_max_s": max(during) if during else None,
            "during_gaps": len(during),
            "steady_tpot_s": steady_tpot,
            "during_tpot_s": per_dec_during_mean,
            "during_tpot_p99_s": tpot_p99_during,
            "tpot_p99_over_steady": (tpot_p99_during / steady_tpot
                                     if tpot_p99_during and steady_tpot else None),
            "p99_over_steady": (p99_during / steady_med) if p99_during and steady_med else None,
            "decoder_tpot_s": [
                (rec["finish_time"] - rec["first_token_time"]) / (rec["n_tokens"] - 1)
                if rec.get("status") == "finished" and rec["n_tokens"] > 1 else None
                for rec in recs],
            "timeline": [[_r(t - t_start, 3) for t in rec.get("token_times", [])]
                         for rec in recs],
            "windows": [[_r(a - t_start, 3), _r(b - t_start, 3)] for a, b in windows],
            "foreign_cores": foreign,
            "error": err,
            **{k2: v for k2, v in idle.items() if k2 in ("blocks_ok", "engine_error")},
        }
        out["variants"][vname] = res
        print(f"[chunk] {vname}: TPOT during long prefill p99 {_f(tpot_p99_during, '.3f')} s vs "
              f"steady {_f(steady_tpot, '.3f')} s = {_f(res['tpot_p99_over_steady'])}x; "
              f"steady ITL p50 {_f(steady_med, '.3f')} s, during long prefill "
              f"p99 {_f(p99_during, '.3f')} s (max {_f(res['during_itl_max_s'], '.3f')} s, "
              f"{len(during)} gaps), ratio {_f(res['p99_over_steady'], '.2f')}x, prefill "
              f"{', '.join(f'{x:.2f}' for x in res['long_prefill_s'])} s, other load "
              f"{_f(foreign)}" + (f" ERROR {err}" if err else ""), flush=True)
    return out


# ------------------------------------------------------------------------------------------
# Experiment 3: priority under saturating batch traffic
# ------------------------------------------------------------------------------------------


async def _priority_run(args: argparse.Namespace, policy: str,
                        sched: list[tuple[float, TraceRequest]], tag: str) -> dict[str, Any]:
    """One open-loop run of the priority experiment; batch tokens counted within duration."""
    from policies import DEFAULT_CLASSES

    duration = args.priority_duration
    kwargs = engine_kwargs(args, policy, True, policy == "priority")
    aeng, _ = await start_engine(kwargs, args)
    recs, info = await run_open_loop(
        aeng, sched, admission=False, predict=False, duration=duration,
        drain=args.drain, tag=tag, record_tokens=True, drain_only={"interactive"})
    await stop_engine(aeng)
    del aeng
    t0 = info["t0"]
    in_window = sum(sum(1 for t in r.get("token_times", []) if t <= t0 + duration)
                    for r in recs if r["cls"] == "batch")
    summ = summarize(recs, DEFAULT_CLASSES, duration, info["wall_s"], info["t_end"])
    res = {"engine": kwargs, "summary": summ,
           "batch_tok_s_in_window": in_window / duration,
           "interactive_ttft_s": [r["ttft_s"] for r in recs if r["cls"] == "interactive"],
           **{k: v for k, v in info.items() if k not in ("t0", "t_end")}}
    i = summ["interactive"]
    print(f"[priority] {tag}: batch {res['batch_tok_s_in_window']:.1f} tok/s in window; "
          f"interactive TTFT p50 {_f(i['ttft_p50_s'])} p99 {_f(i['ttft_p99_s'])} s "
          f"({i['offered']} req, {i['cut_off']} cut off), preemptions "
          f"{info['preemptions']}, other load {_f(info['foreign_cores'])}", flush=True)
    return res


async def exp_priority(wl: Workload, args: argparse.Namespace, capacity: float) -> dict[str, Any]:
    duration = args.priority_duration
    batch_sched, _ = wl.window(args.batch_load * capacity, duration, cls="batch")
    # The interactive streams replay a later stretch of the same window. Their share of the
    # replica's work (prompt + output tokens, against capacity x the capacity rows' mean
    # request) bounds what batch can keep: at most the rest.
    p_mean, o_mean = wl.mean_lengths(args.capacity_rows)
    streams = {}
    out: dict[str, Any] = {
        "scale": wl.args.prompt_scale, "scaling": wl.scaling(),
        "duration_s": duration, "repeats": args.priority_repeats,
        "batch_rate": args.batch_load * capacity, "batch_requests": len(batch_sched),
        "batch_rows": [batch_sched[0][1].row, batch_sched[-1][1].row] if batch_sched else None,
        "batch_alone": [], "interactive": {},
    }
    for load in args.interactive_loads:
        sched, _ = wl.window(load * capacity, duration, start=args.interactive_offset_rows,
                             cls="interactive")
        streams[load] = sched
        tok_s = sum(len(r.prompt_ids) + r.max_tokens for _, r in sched) / duration
        out["interactive"][f"{load:g}"] = {
            "load_x": load, "rate": load * capacity, "requests": len(sched),
            "rows": [sched[0][1].row, sched[-1][1].row] if sched else None,
            "tok_s": tok_s, "work_share": tok_s / (capacity * (p_mean + o_mean)),
            "fcfs": None, "priority": [], "batch_frac": [], "alone": []}
    for load, sched in streams.items():
        both = sorted(batch_sched + sched, key=lambda x: x[0])
        out["interactive"][f"{load:g}"]["fcfs"] = await _priority_run(
            args, "fcfs", both, f"mixed-fcfs@{load:g}x")
        # Each interactive stream alone: the floor of its TTFT, since no scheduler serves
        # it faster beside batch traffic than on a replica of its own.
        out["interactive"][f"{load:g}"]["alone"].append(await _priority_run(
            args, "priority", sched, f"interactive-alone@{load:g}x"))
    # Batch-alone runs bracket each repeat's mixed runs (alone, mixed..., alone, ...), and
    # each mixed run's ratio is over the mean of the two alone runs around it: the
    # machine's speed drifts by tens of percent over minutes here, and a linear drift
    # cancels out of a bracketed ratio (one alone run before was off by up to a third).
    mixed_runs: list[tuple[int, float, dict[str, Any]]] = []
    for rep in range(args.priority_repeats):
        out["batch_alone"].append(
            await _priority_run(args, "priority", batch_sched, f"batch-alone#{rep}"))
        for load, sched in streams.items():
            both = sorted(batch_sched + sched, key=lambda x: x[0])
            mixed = await _priority_run(args, "priority", both,
                                        f"mixed-priority@{load:g}x#{rep}")
            out["interactive"][f"{load:g}"]["priority"].append(mixed)
            mixed_runs.append((rep, load, mixed))
    if args.priority_repeats:
        rep = args.priority_repeats
        out["batch_alone"].append(
            await _priority_run(args, "priority", batch_sched, f"batch-alone#{rep}"))
    for rep, load, mixed in mixed_runs:
        before, after = (out["batch_alone"][rep + k]["batch_tok_s_in_window"] for k in (0, 1))
        if before and after:
            out["interactive"][f"{load:g}"]["batch_frac"].append(
                mixed["batch_tok_s_in_window"] / ((before + after) / 2))
    for s in out["interactive"].values():
        ttfts = [t for r in s["priority"] for t in r["interactive_ttft_s"] if t is not None]
        s["ttft_p99_pooled_s"] = pct(ttfts, 99)
        s["alone_ttft_p99_pooled_s"] = pct(
            [t for r in s["alone"] for t in r["interactive_ttft_s"] if t is not None], 99)
        s["ttft_samples"] = len(ttfts)
        s["censored"] = sum(r["summary"]["interactive"]["ttft_censored"] for r in s["priority"])
        s["batch_frac_median"] = statistics.median(s["batch_frac"]) if s["batch_frac"] else None
    return out


# ------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------


def _f(x, spec=".2f", missing="—") -> str:
    return missing if x is None else format(x, spec)


def _pct(x, missing="—") -> str:
    return missing if x is None else f"{100 * x:.0f}%"


def targets(report: dict) -> list[dict]:
    rows = []
    sweep = report.get("sweep") or {}
    slo_int = report["classes"]["interactive"]

    g = {k: v["goodput"] for k, v in sweep.items()}
    if "cont-chunk" in g and "static" in g:
        a, b = g["cont-chunk"], g["static"]
        ga, gb = a["goodput_rps"], b["goodput_rps"]
        if ga is None or gb is None:
            val, met, note = None, None, "missing points"
        elif gb == 0:
            # Static missed 90% even at the lowest load: the ratio is only bounded below.
            val = ga / b["lowest_rate"] if ga > 0 else None
            met = True if val is not None and val >= TARGETS[
                "goodput_cont_chunk_over_static"] else None
            note = (f"lower bound: static < lowest load {_f(b.get('lowest_rate'))} req/s; "
                    f"cont-chunk {_f(ga)} req/s ({a['bound']})")
        else:
            val, met = ga / gb, ga / gb >= TARGETS["goodput_cont_chunk_over_static"]
            note = f"{_f(ga)} vs {_f(gb)} req/s ({a['bound']} / {b['bound']})"
        rows.append({"metric": "goodput cont-chunk / static", "measured": val,
                     "fmt": "x", "target": f"≥{TARGETS['goodput_cont_chunk_over_static']}x",
                     "met": met, "note": note})

    ch = (report.get("experiments") or {}).get("chunk")
    if ch:
        for vname, v in ch["variants"].items():
            r = v["tpot_p99_over_steady"]
            rows.append({
                "metric": f"p99 TPOT of decodes during long prompt / steady ({vname})",
                "measured": r,
                "fmt": "x", "target": f"≤{TARGETS['chunk_stall_p99_over_steady']}x"
                if vname != "no-chunk" else "(baseline)",
                "met": (r <= TARGETS["chunk_stall_p99_over_steady"])
                if r is not None and vname != "no-chunk" else None,
                "note": f"{_f(v['during_tpot_p99_s'], '.3f')} s vs steady "
                        f"{_f(v['steady_tpot_s'], '.3f')} s; single gaps (ITL) p99/p50: "
                        f"{_f(v['p99_over_steady'])}x"})

    adm = (report.get("experiments") or {}).get("admission")
    if adm:
        for pair in adm["pairs"]:
            on = pair["on"]
            att = on["admitted_interactive_attainment"]
            rows.append(_at_least_row(
                f"{pair['on_config']} @ {pair['load_x']:g}x: admitted interactive meeting SLOs",
                att, "admission_admitted_interactive_attainment",
                f"off: {_pct(pair['off']['admitted_interactive_attainment'])}"
                if pair.get("off") else ""))
            rows.append(_at_least_row(
                f"{pair['on_config']} @ {pair['load_x']:g}x: SLO goodput / peak",
                on["goodput_frac_of_peak"], "admission_goodput_frac_of_peak",
                f"{_f(on['goodput_rate'])} of peak {_f(pair['peak_goodput_rate'])} req/s"
                + (f"; off: {_pct(pair['off']['goodput_frac_of_peak'])}"
                   if pair.get("off") else "")))

    pr = (report.get("experiments") or {}).get("priority")
    for key, st in ((pr or {}).get("interactive") or {}).items():
        p99 = st["ttft_p99_pooled_s"]
        fcfs = st["fcfs"]["summary"]["interactive"] if st["fcfs"] else {}
        rows.append({
            "metric": f"priority @ interactive {key}x: interactive p99 TTFT under batch "
                      "saturation", "measured": p99, "fmt": "s",
            "target": f"≤{slo_int['ttft_slo_s']} s (SLO)",
            "met": None if p99 is None else (p99 <= slo_int["ttft_slo_s"]
                                             and not st["censored"]),
            "note": f"lengths / {pr['scale']:g}; "
                    f"{st['ttft_samples']} requests over {len(st['priority'])} runs; "
                    f"interactive alone (no batch): {_f(st.get('alone_ttft_p99_pooled_s'))} "
                    "s; fcfs: " + ("≥" if fcfs.get("ttft_censored") else "")
                    + _f(fcfs.get("ttft_p99_s")) + " s"})
        row = _at_least_row(
            f"priority @ interactive {key}x: batch throughput / batch alone",
            st["batch_frac_median"], "priority_batch_tput_frac_of_alone",
            f"median of {len(st['batch_frac'])} runs, each over the mean of the batch-alone "
            f"runs before and after it ({', '.join(_pct(x) for x in st['batch_frac'])}); "
            f"interactive traffic is {_pct(st['work_share'])} of capacity in tokens")
        if st["work_share"] > PRIORITY_BATCH_MAX_WORK_SHARE:
            row["target"] = f"not judged (ceiling {_pct(1 - st['work_share'])})"
            row["met"] = None
        rows.append(row)
    return rows


def _at_least_row(metric: str, value: float | None, target: str, note: str) -> dict:
    """A target row for a fraction that must reach ``TARGETS[target]``."""
    t = TARGETS[target]
    return {"metric": metric, "measured": value, "fmt": "%", "target": f"≥{100 * t:.0f}%",
            "met": None if value is None else value >= t, "note": note}


def admission_experiment(sweep: dict) -> dict | None:
    pairs = []
    for on_name, off_name in (("cont-chunk+adm", "cont-chunk"), ("priority+adm", "priority")):
        if on_name not in sweep:
            continue
        on_pts = sweep[on_name]["points"]
        top = max(on_pts, key=lambda p: p["load_x"])
        peers = [on_pts] + ([sweep[off_name]["points"]] if off_name in sweep else [])
        peak = max(p["summary"]["all"]["goodput_rate"] for pts in peers for p in pts)

        def view(p, peak=peak):
            s = p["summary"]
            return {"load_x": p["load_x"], "rate_offered": p["rate_offered"],
                    "admitted_interactive_attainment":
                        s["interactive"]["attainment_admitted"],
                    "offered_attainment": s["all"]["attainment_offered"],
                    "rejected": s["all"]["rejected"],
                    "goodput_rate": s["all"]["goodput_rate"],
                    "goodput_frac_of_peak": s["all"]["goodput_rate"] / peak if peak else None}

        off = None
        if off_name in sweep:
            match = [p for p in sweep[off_name]["points"] if p["load_x"] == top["load_x"]]
            off = view(match[0]) if match else None
        pairs.append({"on_config": on_name, "off_config": off_name, "load_x": top["load_x"],
                      "peak_goodput_rate": peak,
                      "peak_over": [on_name] + ([off_name] if off_name in sweep else []),
                      "on": view(top), "off": off})
    return {"pairs": pairs} if pairs else None


def print_report(report: dict) -> None:
    tr = report["trace"]
    cap = report["capacity"]
    print()
    print(f"## iterserve scheduling benchmark ({'quick' if report['quick'] else 'full'} run)")
    print()
    print(f"Workload: {tr['attribution']}.")
    print(f"Window: {tr['window']}. {tr['scaling']}. Mix: {tr['mix']}.")
    print(f"Capacity: {_f(cap['rps'], '.3f')} req/s ({cap['source']}); "
          f"step-model SLO estimate {_f(cap.get('model_slo_rps'), '.3f')} req/s "
          f"(a, b, c = {', '.join(f'{x:.4g}' for x in cap.get('step_coefficients', []))}). "
          f"Per point: {report['duration_s']:g} s of arrivals, cut-off {report['drain_s']:g} s "
          "later.")
    cl = report["classes"]
    print("SLOs: " + "; ".join(f"{k} TTFT {v['ttft_slo_s']} s / TPOT {v['tpot_slo_s']} s"
                               for k, v in cl.items() if k in ("interactive", "batch")))
    print()
    sweep = report.get("sweep") or {}
    if sweep:
        print("| config | load | req/s | n | rej | cut | attain all | attain int "
              "(admitted) | attain batch | int TTFT p50/p99 s | int TPOT p50/p99 s "
              "| batch TTFT p99 s | out tok/s | SLO goodput req/s | pred TTFT MAE s "
              "| other load |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, res in sweep.items():
            for p in res["points"]:
                s = p["summary"]
                a, i, b = s["all"], s["interactive"], s["batch"]
                ge = "≥" if i["ttft_censored"] else ""
                pred = p.get("prediction") or {}
                flags = "" if p["blocks_ok"] else " LEAK"
                print(f"| {name}{flags} | {p['load_x']:g}x | {p['rate_offered']:.2f} | "
                      f"{a['offered']} | {a['rejected']} | {a['cut_off']} | "
                      f"{_pct(a['attainment_offered'])} | {_pct(i['attainment_offered'])} "
                      f"({_pct(i['attainment_admitted'])}) | {_pct(b['attainment_offered'])} | "
                      f"{_f(i['ttft_p50_s'])}/{ge}{_f(i['ttft_p99_s'])} | "
                      f"{_f(i['tpot_p50_s'], '.3f')}/{_f(i['tpot_p99_s'], '.3f')} | "
                      f"{'≥' if b['ttft_censored'] else ''}{_f(b['ttft_p99_s'], '.1f')} | "
                      f"{_f(a['output_tok_s'], '.1f')} | {_f(a['goodput_rate'])} | "
                      f"{_f(pred.get('mae_s'))} | {_f(p['foreign_cores'])} |")
        print()
        print("| config | goodput req/s (≥90% attain) | how | x capacity |")
        print("|---|---:|---|---:|")
        for name, res in sweep.items():
            g = res["goodput"]
            gx = g["goodput_rps"] / report["capacity"]["rps"] if g["goodput_rps"] else None
            how = {"interpolated": "interpolated", "below_lowest_load": "< lowest load",
                   "at_least_highest_load": "≥ (all loads pass)", "no_points": "—"}[g["bound"]]
            print(f"| {name} | {_f(g['goodput_rps'])} | {how} | {_f(gx)} |")
        print()
        preds = [(n, p) for n, r in sweep.items() for p in r["points"] if p.get("prediction")]
        if preds:
            print("Admission model, predicted vs actual TTFT from the moment of sending "
                  "(policies.PredictionLog):")
            print()
            print("| config | load | pairs | MAE s | median rel err | mean signed (pred-act) s "
                  "| p90 abs err s |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            for n, p in preds:
                q = p["prediction"]
                print(f"| {n} | {p['load_x']:g}x | {q['count']} | {_f(q['mae_s'], '.3f')} | "
                      f"{_pct(q['median_rel_error'])} | {_f(q['mean_signed_error_s'], '.3f')} | "
                      f"{_f(q['p90_abs_error_s'], '.3f')} |")
            print()
    ex = report.get("experiments") or {}
    if ex.get("chunk"):
        ch = ex["chunk"]
        print(f"Long prompt ({ch['long_prompt_tokens']} tokens, x{ch['repeats']}) arriving while "
              f"{ch['decoders']} interactive requests decode (inter-token gaps of the decoders):")
        print()
        print("| variant | steady TPOT s | TPOT during p99 s | TPOT ratio | steady ITL p50 s "
              "| during ITL p50 s | during p99 s | during max s | ITL p99 / p50 "
              "| long prefill s | decoder TPOT s (whole request) | other load |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
        for vname, v in ch["variants"].items():
            tp = ", ".join(_f(x, ".3f") for x in v["decoder_tpot_s"])
            print(f"| {vname} | {_f(v['steady_tpot_s'], '.3f')} | "
                  f"{_f(v['during_tpot_p99_s'], '.3f')} | {_f(v['tpot_p99_over_steady'])}x | "
                  f"{_f(v['steady_itl_p50_s'], '.3f')} | "
                  f"{_f(v['during_itl_p50_s'], '.3f')} | {_f(v['during_itl_p99_s'], '.3f')} | "
                  f"{_f(v['during_itl_max_s'], '.3f')} | {_f(v['p99_over_steady'])}x | "
                  f"{', '.join(_f(x) for x in v['long_prefill_s'])} | {tp} | "
                  f"{_f(v['foreign_cores'])} |")
        print()
    if ex.get("priority"):
        pr = ex["priority"]
        pc = pr["capacity"]
        print(f"Priority under saturating batch traffic: {pr['scaling']}; capacity "
              f"{_f(pc['rps'], '.3f')} req/s ({pc['source']}); batch {pr['batch_rate']:.2f} "
              f"req/s ({pr['batch_requests']} req), {pr['duration_s']:.0f} s per run, "
              f"{pr['repeats']} repeat(s):")
        print()
        print("| run | interactive | batch tok/s (within duration) | / alone | int TTFT p50/p99 s "
              "| int attain | int TPOT p99 s | batch TTFT p99 s | preemptions | other load |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")

        def line(name, desc, r, frac=None):
            i, b = r["summary"]["interactive"], r["summary"]["batch"]
            print(f"| {name} | {desc} | {r['batch_tok_s_in_window']:.1f} | "
                  f"{_pct(frac) if frac is not None else ''} | "
                  f"{_f(i['ttft_p50_s'])}/{'≥' if i['ttft_censored'] else ''}"
                  f"{_f(i['ttft_p99_s'])} | {_pct(i['attainment_offered'])} | "
                  f"{_f(i['tpot_p99_s'], '.3f')} | "
                  f"{'≥' if b['ttft_censored'] else ''}{_f(b['ttft_p99_s'], '.1f')} | "
                  f"{r['preemptions']} | {_f(r['foreign_cores'])} |")

        for k, r in enumerate(pr["batch_alone"]):
            line(f"batch-alone #{k}", "none", r)
        for key, st in pr["interactive"].items():
            desc = (f"{key}x: {st['rate']:.2f} req/s, {st['requests']} req, "
                    f"{_pct(st['work_share'])} of capacity")
            if st["fcfs"]:
                line("mixed-fcfs", desc, st["fcfs"])
            for r in st.get("alone", []):
                line("interactive-alone", desc, r)
            for k, r in enumerate(st["priority"]):
                frac = st["batch_frac"][k] if k < len(st["batch_frac"]) else None
                line(f"mixed-priority #{k}", desc, r, frac)
        print()
    rows = report["targets"]
    if rows:
        print("| target | measured | target | met | note |")
        print("|---|---:|---:|---|---|")
        for t in rows:
            v = t["measured"]
            if v is None:
                m = "—"
            elif t["fmt"] == "%":
                m = _pct(v)
            elif t["fmt"] == "x":
                m = f"{v:.2f}x"
            else:
                m = f"{v:.2f} s"
            print(f"| {t['metric']} | {m} | {t['target']} | {t['met']} | {t['note']} |")
        print()
    problems = report.get("problems") or []
    if problems:
        print("Problems seen:")
        for p in problems:
            print(f"- {p}")
        print()


def plots(report: dict, stem: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    written = []
    sweep = report.get("sweep") or {}
    if sweep:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for name, res in sweep.items():
            pts = sorted(res["points"], key=lambda p: p["rate_offered"])
            xs = [p["rate_offered"] for p in pts]
            axes[0].plot(xs, [100 * (p["summary"]["all"]["attainment_offered"] or 0)
                              for p in pts], marker="o", label=name)
            axes[1].plot(xs, [p["summary"]["all"]["goodput_rate"] for p in pts], marker="o",
                         label=name)
        axes[0].axhline(100 * GOODPUT_ATTAINMENT, color="gray", ls="--", lw=1)
        axes[0].set_ylabel("SLO attainment of offered requests (%)")
        axes[1].set_ylabel("requests meeting SLOs per second")
        for ax in axes:
            ax.set_xlabel("offered load (req/s)")
            ax.axvline(report["capacity"]["rps"], color="gray", ls=":", lw=1)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle("Attainment and SLO goodput vs offered load (dotted: capacity)")
        fig.tight_layout()
        p = stem.with_name(stem.name + "_goodput.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(str(p))

        # The loads every config ran (refinement points differ between configs).
        loads = sorted(set.intersection(*({p["load_x"] for p in r["points"]}
                                          for r in sweep.values())))
        show = loads if len(loads) <= 3 else [loads[0], loads[len(loads) // 2], loads[-1]]
        slo = report["classes"]["interactive"]
        fig, axes = plt.subplots(2, len(show), figsize=(4.5 * len(show), 7.5), squeeze=False)
        for j, x in enumerate(show):
            for name, res in sweep.items():
                pt = next((p for p in res["points"] if p["load_x"] == x), None)
                if pt is None:
                    continue
                for row, key in ((0, "ttft_s"), (1, "tpot_s")):
                    vals = sorted(r[key] for r in pt["records"]
                                  if r["cls"] == "interactive" and r.get(key) is not None)
                    if vals:
                        ys = [(k + 1) / len(vals) for k in range(len(vals))]
                        axes[row][j].step(vals, ys, where="post", label=name)
            axes[0][j].axvline(slo["ttft_slo_s"], color="gray", ls="--", lw=1)
            axes[1][j].axvline(slo["tpot_slo_s"], color="gray", ls="--", lw=1)
            axes[0][j].set_title(f"interactive, load {x:g}x")
            axes[0][j].set_xlabel("TTFT (s)")
            axes[1][j].set_xlabel("TPOT (s)")
            for row in (0, 1):
                axes[row][j].set_xscale("log")
                axes[row][j].xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                axes[row][j].xaxis.set_minor_formatter(NullFormatter())
                axes[row][j].set_ylabel("CDF")
                axes[row][j].grid(alpha=0.3)
                axes[row][j].legend(fontsize=7)
        fig.suptitle("Interactive TTFT / TPOT CDFs (dashed: SLO; rejected requests absent, "
                     "cut-off ones at their TTFT lower bound)")
        fig.tight_layout()
        p = stem.with_name(stem.name + "_cdf.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(str(p))

    ch = (report.get("experiments") or {}).get("chunk")
    if ch:
        vs = ch["variants"]
        fig, axes = plt.subplots(len(vs), 1, figsize=(10, 2.6 * len(vs)), squeeze=False)
        for ax, (vname, v) in zip(axes[:, 0], vs.items()):
            for k, ts in enumerate(v["timeline"]):
                if len(ts) > 1:
                    ax.plot(ts[1:], [b - a for a, b in zip(ts, ts[1:])], marker=".", lw=0.8,
                            label=f"decoder {k}")
            for a, b in v["windows"]:
                ax.axvspan(a, b, color="orange", alpha=0.25)
            ax.set_title(f"{vname}: inter-token gap of running decodes "
                         "(shaded: long prompt prefilling)", fontsize=9)
            ax.set_ylabel("gap (s)")
            ax.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("time (s)")
        fig.tight_layout()
        p = stem.with_name(stem.name + "_chunk.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(str(p))
    return written


# ------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------


def estimate_s(args, configs, loads, experiments) -> float:
    engine_start = 8.0
    t = 0.0 if args.capacity else args.capacity_duration + engine_start + 3
    t += len(configs) * engine_start
    t += len(configs) * len(loads) * (args.duration + 0.5 * args.drain + 2)
    # Extra low-load points: expect them for the configs without continuous batching.
    n_low = sum(1 for c in configs if CONFIGS[c]["policy"] == "static")
    t += min(args.extra_low_points, 1) * n_low * (args.duration + 2)
    t += args.goodput_refine * len(configs) * (args.duration + 0.5 * args.drain + 2)
    if "chunk" in experiments:
        nv = len([v for v in args.chunk_variants.split(",") if v.strip()])
        t += nv * (engine_start + 15 + 6 * args.long_repeats)
    if "priority" in experiments:
        if not (args.priority_capacity or _priority_at_sweep_scale(args)):
            t += args.capacity_duration + engine_start + 3
        nl = len(args.interactive_loads)
        runs = 2 * nl + args.priority_repeats * (1 + nl) + 1
        t += runs * (engine_start + args.priority_duration + 0.5 * args.drain + 2)
    return t


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: loads 0.5,2; configs static,cont-chunk,cont-chunk+adm; "
                         "15 s per point (+6 s drain); no chunk/priority experiments unless "
                         "asked")
    ap.add_argument("--duration", type=float, default=None,
                    help="seconds of arrivals per point (default 50; quick 15)")
    ap.add_argument("--drain", type=float, default=None,
                    help="cut-off after the last arrival, seconds (default 40; quick 6)")
    ap.add_argument("--loads", default=None,
                    help="comma-separated multiples of capacity (default 0.25,0.5,1,1.5,2; "
                         "quick 0.5,2)")
    ap.add_argument("--configs", default=None,
                    help=f"comma-separated subset of {','.join(CONFIGS)}, or 'none' "
                         f"(default all; quick {','.join(QUICK_CONFIGS)})")
    ap.add_argument("--experiments", default=None,
                    help=f"comma-separated subset of {','.join(EXPERIMENTS)}, or 'none' "
                         "(default all; quick: admission)")
    ap.add_argument("--capacity", type=float, default=None,
                    help="capacity in req/s; skips the closed-loop measurement")
    ap.add_argument("--capacity-concurrency", type=int, default=12)
    ap.add_argument("--capacity-duration", type=float, default=None,
                    help="seconds of the closed-loop measurement (default 30; quick 10)")
    ap.add_argument("--capacity-rows", type=int, default=200,
                    help="window rows cycled by the closed loop")
    ap.add_argument("--window-start", type=int, default=0, help="first trace row")
    ap.add_argument("--max-window-rows", type=int, default=6000)
    ap.add_argument("--rate-rows", type=int, default=2000,
                    help="rows over which the trace's own mean rate is measured")
    ap.add_argument("--prompt-scale", type=float, default=8.0)
    ap.add_argument("--output-scale", type=float, default=8.0)
    ap.add_argument("--min-prompt", type=int, default=4)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--min-output", type=int, default=2)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--interactive-frac", type=float, default=0.7)
    ap.add_argument("--extra-low-points", type=int, default=None,
                    help="if a config misses 90%% attainment at its lowest load, add up to this "
                         "many points at half the lowest load (default 1; quick 0)")
    ap.add_argument("--goodput-refine", type=int, default=None,
                    help="points added per config by halving its goodput bracket "
                         "(default 2; quick 0)")
    ap.add_argument("--chunk-budget", type=int, default=128,
                    help="max_num_batched_tokens of the chunked configs")
    ap.add_argument("--nochunk-budget", type=int, default=2048,
                    help="max_num_batched_tokens without chunking (raised to the longest "
                         "prompt: an unchunked prompt above the budget never runs)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument("--long-prompt", type=int, default=1024)
    ap.add_argument("--long-repeats", type=int, default=None, help="default 2; quick 1")
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--chunk-variants", default="off,512,128,64,32,16",
                    help="'off' and/or chunk budgets for the chunk experiment")
    ap.add_argument("--batch-load", type=float, default=2.0,
                    help="priority experiment: batch traffic, x capacity")
    ap.add_argument("--interactive-loads", default="0.05,0.1",
                    help="priority experiment: interactive traffic, x capacity (requests), "
                         "comma-separated")
    ap.add_argument("--priority-scale", type=float, default=16.0,
                    help="priority experiment: both length divisors (default 16; the "
                         "sweep's are --prompt-scale / --output-scale); at another scale "
                         "than the sweep's, its capacity is measured at its own")
    ap.add_argument("--priority-capacity", type=float, default=None,
                    help="priority experiment's capacity in req/s; skips its measurement "
                         "when its scale differs from the sweep's")
    ap.add_argument("--priority-duration", type=float, default=None,
                    help="priority experiment: seconds of arrivals per run (default 45; "
                         "quick 30)")
    ap.add_argument("--priority-repeats", type=int, default=None,
                    help="priority experiment: alone/mixed run pairs (default 3; quick 1)")
    ap.add_argument("--interactive-offset-rows", type=int, default=3000,
                    help="priority experiment: window row where the interactive stream starts")
    ap.add_argument("--no-tpot-guard", action="store_true",
                    help="turn off the engine's TPOT SLO guard in the configs that run it "
                         "(cont-chunk, priority, cont-chunk+adm, priority+adm)")
    ap.add_argument("--tpot-guard-target", type=float, default=None,
                    help="EngineConfig.tpot_slo_guard_target of the configs that run the "
                         "guard (default: the engine's, 0.85)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--step-log", type=Path, default=None,
                    help="append one JSON line per engine step to this file (see StepLog)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path; plots go beside it (default bench/results/scheduling.json, "
                         "quick: scheduling_quick.json)")
    args = ap.parse_args(argv)
    q = args.quick
    args.duration = args.duration or (15.0 if q else 50.0)
    args.priority_duration = args.priority_duration or (30.0 if q else 45.0)
    args.priority_repeats = args.priority_repeats or (1 if q else 3)
    args.interactive_loads = [float(x) for x in args.interactive_loads.split(",") if x.strip()]
    args.drain = args.drain if args.drain is not None else (6.0 if q else 40.0)
    args.capacity_duration = args.capacity_duration or (10.0 if q else 30.0)
    args.long_repeats = args.long_repeats or (1 if q else 2)
    if args.extra_low_points is None:
        args.extra_low_points = 0 if q else 1
    if args.goodput_refine is None:
        args.goodput_refine = 0 if q else 2
    args.loads = [float(x) for x in (args.loads or ("0.5,2" if q else "0.25,0.5,1,1.5,2"))
                  .split(",") if x.strip()]
    cfgs = args.configs or ",".join(QUICK_CONFIGS if q else CONFIGS)
    args.config_list = [] if cfgs == "none" else [c.strip() for c in cfgs.split(",") if c.strip()]
    bad = set(args.config_list) - set(CONFIGS)
    if bad:
        ap.error(f"unknown configs {sorted(bad)}; known: {', '.join(CONFIGS)}")
    exps = args.experiments or ("admission" if q else ",".join(EXPERIMENTS))
    args.experiment_list = [] if exps == "none" else [e.strip() for e in exps.split(",")
                                                      if e.strip()]
    bad = set(args.experiment_list) - set(EXPERIMENTS)
    if bad:
        ap.error(f"unknown experiments {sorted(bad)}; known: {', '.join(EXPERIMENTS)}")
    if args.out is None:
        args.out = RESULTS / ("scheduling_quick.json" if q else "scheduling.json")
    return args


async def capacity_of(wl: Workload, args: argparse.Namespace, given: float | None,
                      flag: str, what: str, problems: list[str]) -> dict[str, Any]:
    """Capacity of ``wl`` in req/s: ``given`` (from command-line ``flag``), or measured by
    :func:`measure_capacity`; ``what`` labels the progress lines and ``problems``."""
    if given:
        return {"rps": given, "source": f"given ({flag})"}
    print(f"# measuring capacity{what}: {args.capacity_concurrency} closed-loop clients for "
          f"{args.capacity_duration:g} s on cont-chunk-fixed ...", flush=True)
    m = await measure_capacity(wl, args)
    print(f"# capacity{what} {m['measured_rps']:.3f} req/s ({m['output_tok_s']:.1f} out "
          f"tok/s, {m['completed']} completed); step model (a, b, c) = "
          f"({', '.join(f'{x:.4g}' for x in m['step_coefficients'])}) -> SLO capacity "
          f"{_f(m['model_slo_rps'], '.3f')} req/s; other load "
          f"{_f(m['foreign_cores'])} cores", flush=True)
    if not m.get("blocks_ok", True):
        problems.append(f"capacity run{what}: KV blocks not all free after the run")
    return {"rps": m["measured_rps"], "source": m["method"], **m}


def _priority_at_sweep_scale(args: argparse.Namespace) -> bool:
    return args.priority_scale == args.prompt_scale == args.output_scale


async def priority_workload(wl: Workload, args: argparse.Namespace, capacity: dict[str, Any],
                            problems: list[str]) -> tuple[Workload, dict[str, Any]]:
    """The priority experiment's workload (lengths / ``--priority-scale``) and capacity.

    At the sweep's own scale both are the sweep's; at another, the window is rebuilt
    with that scale (same rows, prompts, classes and seeds) and its capacity measured."""
    s = args.priority_scale
    if _priority_at_sweep_scale(args):
        return wl, capacity
    pargs = argparse.Namespace(**{**vars(args), "prompt_scale": s, "output_scale": s})
    pwl = Workload(pargs)
    return pwl, await capacity_of(pwl, pargs, args.priority_capacity, "--priority-capacity",
                                  f" (priority experiment, lengths / {s:g})", problems)


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    from policies import DEFAULT_CLASSES

    wl = Workload(args)
    longest = max(len(r.prompt_ids) for r in wl.requests)
    args.nochunk_budget = max(args.nochunk_budget, longest)
    t_start = time.perf_counter()
    est = estimate_s(args, args.config_list, args.loads, args.experiment_list)
    print(f"# scheduling benchmark: configs {args.config_list or 'none'}, loads "
          f"{args.loads} x capacity, experiments {args.experiment_list or 'none'}; "
          f"{args.duration:g} s per point (+ up to {args.drain:g} s drain). "
          f"Estimated time: ~{est / 60:.0f} min.", flush=True)
    print(f"# workload: {ATTRIBUTION}; trace mean rate over the first {args.rate_rows} rows "
          f"of the window: {wl.trace_rate:.2f} req/s", flush=True)

    problems: list[str] = []
    capacity = await capacity_of(wl, args, args.capacity, "--capacity", "", problems)
    cap = capacity["rps"]

    sweep = {}
    if args.config_list:
        sweep = await run_sweep(wl, args, cap, args.loads, args.config_list)
    experiments: dict[str, Any] = {}
    if "chunk" in args.experiment_list:
        experiments["chunk"] = await exp_chunk(wl, args)
    if "admission" in args.experiment_list:
        experiments["admission"] = admission_experiment(sweep)
    if "priority" in args.experiment_list:
        pwl, pcap = await priority_workload(wl, args, capacity, problems)
        experiments["priority"] = {**await exp_priority(pwl, args, pcap["rps"]),
                                   "capacity": pcap}

    for name, res in sweep.items():
        for p in res["points"]:
            where = f"{name} @ {p['load_x']:g}x"
            if not p["blocks_ok"]:
                problems.append(f"{where}: KV blocks leaked ({p['blocks_free']}/"
                                f"{p['blocks_total']} free), unfinished {p['engine_unfinished']}")
            if p.get("engine_error"):
                problems.append(f"{where}: engine loop failed: {p['engine_error']}")
            if p.get("client_exceptions"):
                problems.append(f"{where}: client exceptions {p['client_exceptions'][:2]}")
            s = p["summary"]["all"]
            if s["errors"]:
                errs = {r.get("error") for r in p["records"] if r["status"] == "error"}
                problems.append(f"{where}: {s['errors']} requests failed: {sorted(errs)[:2]}")
            if s["wrong_length"]:
                problems.append(f"{where}: {s['wrong_length']} requests got a wrong token count")
    runs = dict((experiments.get("chunk") or {}).get("variants") or {})
    pr = experiments.get("priority") or {}
    runs.update({f"batch-alone#{k}": r for k, r in enumerate(pr.get("batch_alone") or [])})
    for key, st in (pr.get("interactive") or {}).items():
        runs.update({f"mixed-priority@{key}x#{k}": r for k, r in enumerate(st["priority"])})
        runs.update({f"interactive-alone@{key}x": r for r in st["alone"]})
        if st["fcfs"]:
            runs[f"mixed-fcfs@{key}x"] = st["fcfs"]
    for vname, v in runs.items():
        if not v.get("blocks_ok", True):
            problems.append(f"{vname}: KV blocks leaked")
        if v.get("error") or v.get("engine_error"):
            problems.append(f"{vname}: {v.get('error') or v.get('engine_error')}")

    import torch

    first = wl.requests[0]
    last_row = max(wl.max_row_used, args.window_start + args.capacity_rows - 1)
    last = wl.requests[last_row - args.window_start]
    report = {
        "benchmark": "scheduling",
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads()},
        "model": "SmolLM2-135M-Instruct (embedded), engine default dtype (fp32 on CPU)",
        "trace": {
            "file": os.path.relpath(args.trace, REPO),
            "attribution": ATTRIBUTION,
            "window": f"rows {first.row}-{last.row} (TIMESTAMP {first.timestamp} .. "
                      f"{last.timestamp}); per point the first round(rate x duration) "
                      "rows, trace times scaled so that the next row would arrive at the "
                      f"duration (trace's own mean rate over its first {args.rate_rows} rows: "
                      f"{wl.trace_rate:.2f} req/s)",
            "scaling": wl.scaling(),
            "mix": f"{100 * args.interactive_frac:.0f}% interactive / "
                   f"{100 * (1 - args.interactive_frac):.0f}% batch per row "
                   f"(random.Random({args.seed + 1}))",
        },
        "classes": {k: {"ttft_slo_s": v.ttft_slo_s, "tpot_slo_s": v.tpot_slo_s,
                        "max_queue_wait_s": v.max_queue_wait_s, "rejectable": v.rejectable}
                    for k, v in DEFAULT_CLASSES.items()},
        "capacity": capacity,
        "loads_x": args.loads,
        "duration_s": args.duration,
        "drain_s": args.drain,
        "configs": {n: CONFIGS[n]["desc"] for n in args.config_list},
        "sweep": sweep,
        "experiments": experiments,
        "targets_spec": TARGETS,
        "problems": problems,
    }
    report["targets"] = targets(report)
    report["elapsed_s"] = time.perf_counter() - t_start
    report["estimated_s"] = est
    return report


def _finite(x):
    """``x`` with NaN and infinities replaced by None (strict JSON)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    report = asyncio.run(amain(args))
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    stem = args.out.with_suffix("")
    try:
        report["plots"] = plots(report, stem)
    except Exception as e:  # noqa: BLE001 - plots are a convenience
        report["plots_error"] = repr(e)
        print(f"plotting failed: {e!r}")
    args.out.write_text(json.dumps(_finite(report), separators=(",", ":"), default=str) + "\n")
    print(f"wrote {args.out} and {len(report.get('plots', []))} plots "
          f"({report['elapsed_s']:.0f} s in all; estimated {report['estimated_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
