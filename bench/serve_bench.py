"""Open-loop load generator for any OpenAI-compatible ``/v1/completions`` endpoint.

Run from the repository root (the server must already be up)::

    .venv/bin/python bench/serve_bench.py --base-url http://127.0.0.1:8000 --model NAME \\
        --tokenizer DIR --rates 2,3,5,8 --label iterserve

Workload
    A window of the Azure LLM inference trace 2023 (Patel et al., "Splitwise: Efficient
    Generative LLM Inference Using Phase Splitting", ISCA 2024; CC-BY 4.0): rows
    ``--window-start`` .. ``+--num-requests`` of ``../shared/traces/azure_llm_2023_conv.csv``
    (or ``_code.csv``; columns TIMESTAMP, ContextTokens, GeneratedTokens). The real
    inter-arrival times are rescaled per offered rate R so that the N requests span N/R
    seconds (the row after the window would arrive at N/R). Open loop: every request is sent
    at its arrival time whatever happened to earlier ones.
    Lengths: prompt = clamp(round(ContextTokens / length_scale), 4, 1024) tokens, output =
    clamp(round(GeneratedTokens / output_scale), 1, 512) tokens, forced with ``max_tokens``
    and ``ignore_eos``, greedy. Prompts are real English text (docstrings of the top-level
    standard-library modules, parsed with ``ast``, never imported) cut to the exact token
    length under the served model's tokenizer.

Metrics (vLLM's definitions; all in seconds)
    TTFT: scheduled arrival -> first chunk with text (so generator lag counts against it;
    the lag is reported). E2E: scheduled arrival -> end of stream. TPOT: (E2E - TTFT) /
    (output tokens - 1), 0 for one-token outputs. ITL: gaps between successive text chunks.
    A request meets the SLO iff it got status 200, no error event, all its output tokens,
    TTFT <= ``--slo-ttft-s`` and TPOT <= ``--slo-tpot-s``; refusals (429) and failures are
    misses. Goodput (DistServe, Zhong et al., OSDI 2024) is the highest offered rate whose
    attainment is at least ``--attainment-target``.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import csv
import functools
import hashlib
import itertools
import json
import random
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
TRACE_ATTRIBUTION = (
    "Azure LLM inference trace 2023, from Patel et al., 'Splitwise: Efficient Generative LLM "
    "Inference Using Phase Splitting', ISCA 2024; licensed CC-BY 4.0"
)
CORPUS_DESCRIPTION = (
    "docstrings (module, class, function; >= 40 chars) of the top-level *.py files of this "
    "Python's standard library, files in sorted order, nodes in ast.walk order, joined by "
    "blank lines"
)
WARMUP_PROMPT_TOKENS, WARMUP_OUTPUT_TOKENS = 16, 8
RATE_ALLOWANCE_S = 20.0  # per rate, on top of N/R: drain, cooldown, stragglers


@dataclass
class BenchConfig:
    """All options of the benchmark; times in seconds, lengths in tokens, rates in req/s."""

    base_url: str  # server root (``http://host:port``), ``/v1`` root or the full endpoint
    model: str  # the ``model`` field sent; must be the name the server serves
    tokenizer: str  # local transformers directory of the served model's tokenizer
    trace: str = str(DEFAULT_TRACE)
    window_start: int = 0  # index of the first data row used
    num_requests: int = 120
    rates: list[float] = field(default_factory=lambda: [2.0, 3.0, 5.0, 8.0])
    length_scale: float = 8.0  # trace token counts are divided by this
    output_scale: float | None = None  # divisor for output lengths; None: length_scale
    min_prompt: int = 4
    max_prompt: int = 1024
    max_output: int = 512
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.25
    class_mix: dict[str, float] | None = None  # class -> weight; None: no classes
    class_header: str | None = "x-iterserve-class"  # None/"": send no class header
    priority_field: bool = False  # send the class's ``priority`` in the JSON body
    class_priority: dict[str, int] = field(
        default_factory=lambda: {"interactive": 0, "batch": 10})
    attainment_target: float = 0.9
    warmup: int = 4  # short sequential requests sent (and discarded) before the first rate
    cooldown_s: float = 2.0
    max_duration_s: float = 600.0  # per rate; requests still running are cancelled (failed)
    timeout_s: float = 600.0  # httpx timeout per request
    seed: int = 0
    label: str = "server"
    extra_headers: dict[str, str] = field(default_factory=dict)


@dataclass
class BenchRequest:
    """One trace row made into a request."""

    row: int  # index of the trace data row (warmup requests: negative)
    trace_offset_s: float  # trace time since the window's first row, before rescaling
    trace_span_s: float  # trace time from the window's first row to the row after it
    prompt: str
    prompt_tokens: int  # length of ``tokenizer.encode(prompt)``
    prompt_target: int  # the length wanted; prompt_tokens misses it only in rare cases
    output_tokens: int  # max_tokens sent; with ignore_eos, the expected output length
    cls: str | None
    context_tokens: int = 0  # the trace's own lengths, unscaled
    generated_tokens: int = 0


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile (0-100) by linear interpolation; None for an empty list."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# -- workload ----------------------------------------------------------------------------


def read_window(path: str | Path, start: int, n: int) -> list[tuple[float, int, int]]:
    """Rows ``start .. start+n`` (n+1 when the trace has them): (offset s, context, generated)."""
    with open(path, newline="") as f:
        rows = list(itertools.islice(csv.DictReader(f), start, start + n + 1))
    if len(rows) < n:
        raise ValueError(f"{path} has {len(rows)} rows from row {start}; {n} needed")
    t0 = datetime.fromisoformat(rows[0]["TIMESTAMP"])
    return [((datetime.fromisoformat(r["TIMESTAMP"]) - t0).total_seconds(),
             int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in rows]


def arrival_offsets(workload: list[BenchRequest], rate: float) -> list[float]:
    """Scheduled send times (s from the rate's start) at an offered ``rate`` req/s."""
    n, span = len(workload), workload[0].trace_span_s
    if span <= 0:  # all rows at one instant: fall back to even spacing
        return [i / rate for i in range(n)]
    scale = n / rate / span
    return [r.trace_offset_s * scale for r in workload]


def corpus_text() -> str:
    """Deterministic English text that every CPython 3.11 has (see ``CORPUS_DESCRIPTION``)."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    parts: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, kinds))]
        parts.extend(d for d in map(ast.get_docstring, nodes) if d and len(d) >= 40)
    return "\n\n".join(parts)


class PromptMaker:
    """Prompts of an exact token count, cut from the corpus; cached per (row, tokens)."""

    def __init__(self, tokenizer_dir: str, seed: int) -> None:
        from transformers import AutoTokenizer  # slow import; only when prompts are needed

        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        text = corpus_text()
        self.corpus_sha256 = hashlib.sha256(text.encode()).hexdigest()
        self.ids = self.tok.encode(text, add_special_tokens=False, verbose=False)
        # The server calls encode(text), which may prepend BOS (Llama): count it in the length.
        self.special = (len(self.tok.encode("hi"))
                        - len(self.tok.encode("hi", add_special_tokens=False)))
        self.seed = seed
        self._cache: dict[tuple[int, int, int], tuple[str, int]] = {}

    def make(self, row: int, n: int, replay: int = 0) -> tuple[str, int]:
        """(text, actual token count) for a prompt of ``n`` tokens for trace ``row``.

        ``replay`` picks a different text of the same length, so that replaying a window
        at several rates never sends a prompt twice (a server's prefix cache would
        otherwise serve every later rate's prefills from the first rate's KV).
        """
        if (row, n, replay) not in self._cache:
            self._cache[(row, n, replay)] = self._build(row, n, replay)
        return self._cache[(row, n, replay)]

    def _build(self, row: int, n: int, replay: int) -> tuple[str, int]:
        rng = random.Random(f"{self.seed}:prompt:{replay}:{row}")
        first = rng.randrange(max(1, len(self.ids) - 2 * n - 16))
        best: tuple[str, int] | None = None
        # Decode/re-encode rarely round-trips exactly at slice edges: correct the length a
        # few times, and if it oscillates around n, move the slice by one token.
        for start in range(first, first + 4):
            k = max(1, n - self.special)
            for _ in range(6):
                text = self.tok.decode(self.ids[start:start + k], skip_special_tokens=True)
                got = len(self.tok.encode(text))
                if best is None or abs(got - n) < abs(best[1] - n):
                    best = (text, got)
                if got == n:
                    return best
                k = max(1, k + n - got)
        return best


@functools.lru_cache(maxsize=4)
def prompt_maker(tokenizer_dir: str, seed: int) -> PromptMaker:
    """A shared :class:`PromptMaker` (loading the tokenizer and corpus costs ~2 s of CPU)."""
    return PromptMaker(tokenizer_dir, seed)


def _pick_class(mix: dict[str, float] | None, seed: int, row: int) -> str | None:
    if not mix:
        return None
    x = random.Random(f"{seed}:class:{row}").random() * sum(mix.values())
    for name, weight in mix.items():
        x -= weight
        if x < 0:
            return name
    return name


def build_workload(cfg: BenchConfig, replay: int = 0) -> list[BenchRequest]:
    """The window's requests: trace offsets (s, unscaled), prompts, lengths (tokens), class.

    ``replay`` (the rate's index): the same lengths, arrivals and classes with other
    prompt text (see :meth:`PromptMaker.make`).
    """
    if cfg.num_requests < 1 or not cfg.rates or min(cfg.rates) <= 0:
        raise ValueError("need num_requests >= 1 and positive rates")
    if cfg.priority_field and cfg.class_mix:
        missing = set(cfg.class_mix) - set(cfg.class_priority)
        if missing:
            raise ValueError(f"no --class-priority for classes {sorted(missing)}")
    rows = read_window(cfg.trace, cfg.window_start, cfg.num_requests)
    n = cfg.num_requests
    span = rows[n][0] if len(rows) > n else rows[-1][0] * n / max(1, n - 1)
    maker = prompt_maker(cfg.tokenizer, cfg.seed)
    out_scale = cfg.output_scale or cfg.length_scale
    workload = []
    for i, (offset, ctx, gen) in enumerate(rows[:n]):
        row = cfg.window_start + i
        want = max(cfg.min_prompt, min(cfg.max_prompt, round(ctx / cfg.length_scale)))
        text, got = maker.make(row, want, replay)
        out = max(1, min(cfg.max_output, round(gen / out_scale)))
        workload.append(BenchRequest(row, offset, span, text, got, want, out,
                                     _pick_class(cfg.class_mix, cfg.seed, row), ctx, gen))
    return workload


# -- one request -------------------------------------------------------------------------


def completions_url(base_url: str) -> str:
    """The completions endpoint for a server root, a ``/v1`` root or the endpoint itself."""
    base = base_url.rstrip("/")
    if base.endswith("/v1/completions"):
        return base
    return base + ("/completions" if base.endswith("/v1") else "/v1/completions")


def _request_parts(cfg: BenchConfig, req: BenchRequest) -> tuple[dict, dict[str, str]]:
    body: dict[str, Any] = {
        "model": cfg.model, "prompt": req.prompt, "max_tokens": req.output_tokens,
        "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = dict(cfg.extra_headers)
    if req.cls is not None:
        if cfg.class_header:
            headers[cfg.class_header] = req.cls
        if cfg.priority_field:
            body["priority"] = cfg.class_priority[req.cls]
    return body, headers


def _new_record(req: BenchRequest, arrival_s: float) -> dict[str, Any]:
    return {"row": req.row, "class": req.cls, "arrival_s": arrival_s, "send_s": None,
            "lag_s": None, "end_s": None, "prompt_tokens": req.prompt_tokens,
            "server_prompt_tokens": None, "output_tokens_expected": req.output_tokens,
            "output_tokens": 0, "status": None, "error": None, "ttft_s": None,
            "tpot_s": None, "e2e_s": None, "itl_s": [], "chunk_tokens": None,
            "ok": False, "slo_met": False}


async def _read_stream(resp: httpx.Response, rec: dict[str, Any], sched: float) -> None:
    """Parse the SSE stream into ``rec`` (times relative to the scheduled arrival)."""
    last = None
    chunks, seen, steps, done = 0, 0, [], False
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        obj = json.loads(data)
        if obj.get("error") is not None:
            rec["error"] = json.dumps(obj["error"])[:300]
            break
        usage = obj.get("usage") or {}
        if usage.get("prompt_tokens") is not None:
            rec["server_prompt_tokens"] = usage["prompt_tokens"]
        completion = usage.get("completion_tokens")
        choices = obj.get("choices") or []
        if choices and choices[0].get("text"):
            now = time.perf_counter()
            if last is None:
                rec["ttft_s"] = now - sched
            else:
                rec["itl_s"].append(now - last)
            last, chunks = now, chunks + 1
            # Per-chunk token counts only exist when every chunk carries usage (vLLM's
            # continuous_usage_stats); otherwise each chunk counts as one token.
            steps.append(None if completion is None else completion - seen)
        if completion is not None:
            seen = completion
    if not done and rec["error"] is None:
        rec["error"] = "stream ended without [DONE]"
    rec["output_tokens"] = seen or chunks
    if steps and None not in steps:
        rec["chunk_tokens"] = steps
    end = time.perf_counter()
    rec["e2e_s"] = end - sched
    if rec["ttft_s"] is not None:
        out = rec["output_tokens"]
        rec["tpot_s"] = (rec["e2e_s"] - rec["ttft_s"]) / (out - 1) if out > 1 else 0.0


async def _send(client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str],
                rec: dict[str, Any], t0: float) -> None:
    """Send one request at ``t0 + rec['arrival_s']`` (perf_counter s) and fill ``rec``."""
    sched = t0 + rec["arrival_s"]
    await asyncio.sleep(max(0.0, sched - time.perf_counter()))
    sent = time.perf_counter()
    rec["send_s"], rec["lag_s"] = sent - t0, sent - sched
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            rec["status"] = resp.status_code
            if resp.status_code == 200:
                await _read_stream(resp, rec, sched)
            else:
                rec["error"] = (await resp.aread()).decode(errors="replace")[:300]
    except Exception as e:  # a broken server must not stop the benchmark: a failed request
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        rec["end_s"] = time.perf_counter() - t0


def _judge(rec: dict[str, Any], cfg: BenchConfig) -> None:
    rec["ok"] = rec["status"] == 200 and rec["error"] is None
    rec["slo_met"] = (rec["ok"] and rec["output_tokens"] == rec["output_tokens_expected"]
                      and rec["ttft_s"] is not None and rec["ttft_s"] <= cfg.slo_ttft_s
                      and rec["tpot_s"] <= cfg.slo_tpot_s)


def _round_times(rec: dict[str, Any]) -> None:
    # Microseconds are far below what the event loop resolves; the JSON halves in size.
    for k, v in rec.items():
        if k.endswith("_s") and isinstance(v, float):
            rec[k] = round(v, 6)
    rec["itl_s"] = [round(x, 6) for x in rec["itl_s"]]


# -- one rate ----------------------------------------------------------------------------


def _client(cfg: BenchConfig) -> httpx.AsyncClient:
    # trust_env=False: a proxy from the environment must not sit between us and the server.
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        timeout=httpx.Timeout(cfg.timeout_s), trust_env=False)


def _pcts(values: list[float], ps: tuple[int, ...]) -> dict[str, float | None]:
    return {f"p{p}": percentile(values, p) for p in ps}


def _stats(records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Attainment, throughput (per wall second) and latency percentiles (s) of ``records``."""
    ok = [r for r in records if r["ok"]]
    lags = [r["lag_s"] for r in records if r["lag_s"] is not None]
    out_tokens = sum(r["output_tokens"] for r in ok)
    wall = max(wall_s, 1e-9)
    return {
        "requests": len(records), "ok": len(ok),
        "slo_met": sum(r["slo_met"] for r in records),
        "attainment": sum(r["slo_met"] for r in records) / max(1, len(records)),
        "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / wall,
        "requests_per_s": len(ok) / wall,
        "ttft_s": _pcts([r["ttft_s"] for r in ok if r["ttft_s"] is not None], (50, 90, 99)),
        # One-token outputs have TPOT 0 by definition; leaving them out keeps the spread honest.
        "tpot_s": _pcts([r["tpot_s"] for r in ok if r["output_tokens"] > 1], (50, 90, 99)),
        "itl_s": _pcts([x for r in ok for x in r["itl_s"]], (50, 99)),
        "e2e_s": _pcts([r["e2e_s"] for r in ok], (50, 99)),
        "refused": sum(r["status"] == 429 for r in records),
        "failed": sum(not r["ok"] and r["status"] != 429 for r in records),
        "incomplete": sum(r["ok"] and r["output_tokens"] != r["output_tokens_expected"]
                          for r in records),
        "mean_lag_s": sum(lags) / len(lags) if lags else None,
        "max_lag_s": max(lags, default=None),
    }


def summarize(records: list[dict[str, Any]], rate: float, cfg: BenchConfig) -> dict[str, Any]:
    """Summary of one rate: wall time (s, first arrival to last completion), stats, per class."""
    ends = [r["end_s"] for r in records if r["end_s"] is not None]
    wall = max(ends, default=0.0) - min(r["arrival_s"] for r in records)
    summary = {"rate": rate, "wall_s": wall, **_stats(records, wall)}
    summary["meets_target"] = summary["attainment"] >= cfg.attainment_target
    classes = sorted({r["class"] for r in records if r["class"] is not None})
    if classes:
        summary["per_class"] = {c: _stats([r for r in records if r["class"] == c], wall)
                                for c in classes}
    return summary


async def run_rate(cfg: BenchConfig, workload: list[BenchRequest], rate: float,
                   client: httpx.AsyncClient | None = None) -> dict[str, Any]:
    """Replay ``workload`` at ``rate`` req/s; {"summary": ..., "records": [...]} (times in s)."""
    if client is None:
        async with _client(cfg) as own:
            return await run_rate(cfg, workload, rate, own)
    url = completions_url(cfg.base_url)
    records = [_new_record(r, a) for r, a in zip(workload, arrival_offsets(workload, rate))]
    t0 = time.perf_counter() + 0.05  # a small lead so the first request is not already late
    tasks = [asyncio.create_task(_send(client, url, *_request_parts(cfg, req), rec, t0))
             for req, rec in zip(workload, records)]
    _, pending = await asyncio.wait(tasks, timeout=cfg.max_duration_s + 0.05)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task, rec in zip(tasks, records):
        if task in pending:
            rec["error"] = f"cancelled after max_duration_s={cfg.max_duration_s}"
        _judge(rec, cfg)
        _round_times(rec)
        rec["rate"] = rate
    return {"summary": summarize(records, rate, cfg), "records": records}


# -- whole run ---------------------------------------------------------------------------


def expected_duration_s(cfg: BenchConfig) -> float:
    """Rough wall time (s): N/R plus an allowance per rate, warmup and cooldowns."""
    return (sum(cfg.num_requests / r + RATE_ALLOWANCE_S for r in cfg.rates)
            + cfg.warmup * 1.0 + cfg.cooldown_s * max(0, len(cfg.rates) - 1))


def goodput(summaries: list[dict[str, Any]], target: float, cls: str | None = None
            ) -> float | None:
    """Highest offered rate (req/s) whose attainment (of ``cls``, if given) >= ``target``."""
    def attainment(s: dict[str, Any]) -> float:
        return s["attainment"] if cls is None else s["per_class"][cls]["attainment"]
    return max((s["rate"] for s in summaries if attainment(s) >= target), default=None)


async def _warmup(cfg: BenchConfig, client: httpx.AsyncClient) -> int:
    """Send ``cfg.warmup`` short requests one after another; return how many failed."""
    text, got = prompt_maker(cfg.tokenizer, cfg.seed).make(-1, WARMUP_PROMPT_TOKENS)
    req = BenchRequest(-1, 0.0, 0.0, text, got, WARMUP_PROMPT_TOKENS, WARMUP_OUTPUT_TOKENS, None)
    failed = 0
    for _ in range(cfg.warmup):
        rec = _new_record(req, 0.0)
        await _send(client, completions_url(cfg.base_url), *_request_parts(cfg, req), rec,
                    time.perf_counter())
        _judge(rec, cfg)
        failed += not rec["ok"]
    return failed


def _window_info(cfg: BenchConfig, workload: list[BenchRequest]) -> dict[str, Any]:
    prompts = [r.prompt_tokens for r in workload]
    maker = prompt_maker(cfg.tokenizer, cfg.seed)
    return {"first_row": workload[0].row, "last_row": workload[-1].row,
            "num_requests": len(workload), "trace_span_s": workload[0].trace_span_s,
            "prompt_tokens_total": sum(prompts),
            "output_tokens_total": sum(r.output_tokens for r in workload),
            "prompts_off_target": sum(r.prompt_tokens != r.prompt_target for r in workload),
            "classes": {c: sum(r.cls == c for r in workload) for c in (cfg.class_mix or {})},
            "corpus": CORPUS_DESCRIPTION, "corpus_sha256": maker.corpus_sha256,
            "tokenizer_special_tokens": maker.special}


async def run(cfg: BenchConfig) -> dict[str, Any]:
    """Warm up, replay every rate in ``cfg.rates``, compute goodput; the JSON-able report."""
    print(f"[serve_bench] {cfg.label}: expected duration ~{expected_duration_s(cfg):.0f} s "
          f"({len(cfg.rates)} rates x {cfg.num_requests} requests; N/R + "
          f"{RATE_ALLOWANCE_S:.0f} s each; cap {cfg.max_duration_s:.0f} s per rate)", flush=True)
    workload = build_workload(cfg)
    summaries, records = [], []
    async with _client(cfg) as client:
        if cfg.warmup and (failed := await _warmup(cfg, client)):
            print(f"[serve_bench] warning: {failed}/{cfg.warmup} warmup requests failed",
                  file=sys.stderr)
        for i, rate in enumerate(cfg.rates):
            if i:
                await asyncio.sleep(cfg.cooldown_s)
            print(f"[serve_bench] rate {rate:g} req/s: {len(workload)} requests over "
                  f"{len(workload) / rate:.1f} s", file=sys.stderr, flush=True)
            result = await run_rate(cfg, build_workload(cfg, replay=i), rate, client)
            summaries.append(result["summary"])
            if (result["summary"]["max_lag_s"] or 0) > 0.05:  # TTFT includes this lag
                print(f"[serve_bench] warning: generator fell behind by up to "
                      f"{result['summary']['max_lag_s']:.3f} s", file=sys.stderr)
            records.extend(result["records"])
    classes = sorted(cfg.class_mix or {})
    return {
        "benchmark": "serve_bench", "label": cfg.label, "config": asdict(cfg),
        "endpoint": completions_url(cfg.base_url),
        "trace": {"path": cfg.trace, "attribution": TRACE_ATTRIBUTION},
        "window": _window_info(cfg, workload),
        "scaling": ("arrival_i = (t_i - t_0) * N / (R * (t_N - t_0)), t_N the row after the "
                    "window, so N requests span N/R s; prompt = clamp(round(ContextTokens / "
                    "length_scale), min_prompt, max_prompt), output = clamp(round("
                    "GeneratedTokens / (output_scale or length_scale)), 1, max_output)"),
        "slo": {"ttft_s": cfg.slo_ttft_s, "tpot_s": cfg.slo_tpot_s,
                "attainment_target": cfg.attainment_target},
        "summaries": summaries,
        "goodput": {"overall": goodput(summaries, cfg.attainment_target),
                    "per_class": {c: goodput(summaries, cfg.attainment_target, c)
                                  for c in classes}},
        "records": records,
    }


def _fmt(x: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def print_table(report: dict[str, Any]) -> None:
    """One line per rate to stdout: attainment, goodput flag, tok/s, TTFT/TPOT (s), errors."""
    print(f"\n{report['label']}  (SLO: TTFT <= {report['slo']['ttft_s']} s, TPOT <= "
          f"{report['slo']['tpot_s']} s; '*' = attainment >= "
          f"{report['slo']['attainment_target']})")
    print(f"{'rate':>6} {'attain':>7} {'':1} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'TPOT p99':>9} {'refused':>7} {'failed':>6} {'lag':>6}  classes")
    for s in report["summaries"]:
        classes = " ".join(f"{c}={v['attainment']:.2f}" for c, v in s.get("per_class", {}).items())
        print(f"{s['rate']:>6g} {s['attainment']:>7.3f} {'*' if s['meets_target'] else ' '} "
              f"{s['output_tokens_per_s']:>9.1f} {_fmt(s['ttft_s']['p50']):>9} "
              f"{_fmt(s['ttft_s']['p99']):>9} {_fmt(s['tpot_s']['p50']):>9} "
              f"{_fmt(s['tpot_s']['p99']):>9} {s['refused']:>7} {s['failed']:>6} "
              f"{_fmt(s['mean_lag_s'], 1e3, 1):>6}  {classes}")
    g = report["goodput"]
    per = " ".join(f"{c}={v}" for c, v in g["per_class"].items())
    print(f"goodput: {g['overall']} req/s{'  per class: ' + per if per else ''}"
          "   (lag = mean generator lag, ms)")


def write_report(report: dict[str, Any], path: str | Path) -> None:
    """Write ``report`` as JSON: summaries indented, one compact line per request record."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = [f"{json.dumps(k)}: {json.dumps(v, indent=1)}"
             for k, v in report.items() if k != "records"]
    recs = ",\n".join(json.dumps(r, separators=(",", ":")) for r in report.get("records", []))
    parts.append(f'"records": [\n{recs}\n]')
    path.write_text("{\n" + ",\n".join(parts) + "\n}\n")


# -- command line ------------------------------------------------------------------------


def _mapping(cast):
    def parse(text: str) -> dict:
        pairs = [item.partition("=") for item in text.split(",") if item.strip()]
        if any(not sep for _, sep, _ in pairs):
            raise argparse.ArgumentTypeError(f"expected k=v[,k=v...], got {text!r}")
        return {k.strip(): cast(v) for k, _, v in pairs}
    return parse


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME:VALUE, got {text!r}")
    return name.strip(), value.strip()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = BenchConfig("", "", "")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name the server serves")
    p.add_argument("--tokenizer", required=True, help="local transformers tokenizer directory")
    p.add_argument("--trace", default=d.trace)
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=d.rates)
    p.add_argument("--output-scale", type=float, default=None)
    p.add_argument("--class-mix", type=_mapping(float), default=None,
                   help="e.g. interactive=0.7,batch=0.3")
    p.add_argument("--class-header", default=d.class_header, help="'' to send no header")
    p.add_argument("--priority-field", action="store_true")
    p.add_argument("--class-priority", type=_mapping(int), default=d.class_priority)
    p.add_argument("--header", type=_header, action="append", default=[],
                   help="extra header NAME:VALUE (repeatable)")
    for name in ("window_start", "num_requests", "min_prompt", "max_prompt", "max_output",
                 "warmup", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("length_scale", "slo_ttft_s", "slo_tpot_s", "attainment_target",
                 "cooldown_s", "max_duration_s", "timeout_s"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    p.add_argument("--label", default=d.label)
    p.add_argument("--out", default=str(REPO_ROOT / "bench" / "results" / "serve_bench.json"))
    return p


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = vars(_parser().parse_args(argv))
    out = args.pop("out")
    args["extra_headers"] = dict(args.pop("header"))
    args["class_header"] = args["class_header"] or None
    cfg = BenchConfig(**args)
    report = asyncio.run(run(cfg))
    print_table(report)
    write_report(report, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
