"""The serving benchmark's workload: what makes its comparisons fair."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import peers
from bench.toolkit import serve_bench as sb


def test_each_replay_sends_new_prompts_of_the_same_lengths(model_dir, tmp_path):
    # A server's prefix cache would serve a later rate's prompts from an earlier rate's
    # KV if the text repeated (vLLM's did: 31% hits, and its attainment rose with load).
    trace = tmp_path / "trace.csv"  # the trace's format; the real one lives outside the repo
    rows = [f"2023-11-16 18:15:{i:02d}.5,{200 + 40 * i},{10 + i}" for i in range(13)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    cfg = sb.BenchConfig(
        base_url="http://unused",
        model="m",
        tokenizer=str(model_dir),
        trace=str(trace),
        window_start=0,
        num_requests=12,
        rates=[1.0, 2.0],
    )
    first, second = sb.build_workload(cfg, 1.0, replay=0), sb.build_workload(cfg, 1.0, replay=1)
    assert [r.prompt_tokens for r in first] == [r.prompt_tokens for r in second]
    assert [r.max_tokens for r in first] == [r.max_tokens for r in second]
    assert [r.arrival_s for r in first] == [r.arrival_s for r in second]
    assert not {r.prompt for r in first} & {r.prompt for r in second}
    assert [r.prompt for r in sb.build_workload(cfg, 1.0, replay=0)] == [r.prompt for r in first]
    # Twice the rate: the same pattern, twice as fast; the 13th row ends the 12-request span.
    assert [2 * r.arrival_s for r in sb.build_workload(cfg, 2.0)] == pytest.approx(
        [r.arrival_s for r in first]
    )
    assert first[-1].arrival_s == pytest.approx(11 / 12 * 12 / 1.0)


def test_host_factor_scales_slos_up_and_rates_down():
    args = peers.parse_args([])
    slow = {"vllm": {"median": {"stream1_ms_per_step": 2 * peers.REFERENCE_STREAM1_MS}}}
    factor = peers.host_factor(args, slow)
    assert factor["k"] == 2.0
    s = peers.scaled(args, factor["k"])
    assert (s.slo_ttft_s, s.slo_tpot_s) == (2 * args.slo_ttft_s, 2 * args.slo_tpot_s)
    assert s.rates == [r / 2 for r in args.rates]
    assert s.max_rate_s == 2 * args.max_rate_s
    # A faster host than the reference keeps the benchmark's own SLOs and rates.
    fast = {"vllm": {"median": {"stream1_ms_per_step": peers.REFERENCE_STREAM1_MS / 2}}}
    assert peers.host_factor(args, fast)["k"] == 1.0
    assert peers.host_factor(peers.parse_args(["--host-factor", "1.5"]), None)["k"] == 1.5
    assert peers.host_factor(args, None)["k"] == 1.0
    for bad in ("fast", "0", "-2"):
        with pytest.raises(SystemExit):
            peers.parse_args(["--host-factor", bad])


def test_base_tree_serves_another_checkout_as_iterserve_base(tmp_path):
    # The before/after comparison: iterserve-base is iterserve with the other tree first on
    # PYTHONPATH; without --base-tree, or with a tree that is no checkout, it is refused.
    import json

    from bench.toolkit.servers import SYSTEMS

    root = Path(__file__).resolve().parents[1]
    args = peers.parse_args(["--base-tree", str(root), "--systems", "vllm,iterserve-base"])
    base = peers.system(args, "iterserve-base")
    assert (base.kind, base.env) == ("iterserve", {"PYTHONPATH": str(root)})
    assert peers.system(args, "vllm") is SYSTEMS["vllm"] and "iterserve-base" not in SYSTEMS
    json.dumps(vars(args))  # the report records its arguments
    for argv in (["--systems", "iterserve-base"], ["--base-tree", str(tmp_path)]):
        with pytest.raises(SystemExit):
            peers.parse_args(argv)


class _FakeTarget:
    """Refuses 'refuse', fails 'fail', else yields one token every ``gap_s`` after
    ``first_s``; ``slow`` requests never finish."""

    def __init__(self, first_s: float = 0.05, gap_s: float = 0.01) -> None:
        self.first_s, self.gap_s = first_s, gap_s

    async def stream(self, req, rec):
        import asyncio

        from bench.toolkit.loadgen import Refused

        if req.cls == "refuse":
            raise Refused("queue full", retry_after_s=1.0)
        if req.cls == "fail":
            raise RuntimeError("boom")
        await asyncio.sleep(self.first_s)
        for i in range(req.max_tokens):
            if i:
                await asyncio.sleep(self.gap_s if req.cls != "slow" else 10)
            yield 1


def test_open_loop_judges_each_request_as_vllm_does():
    import asyncio

    from bench.toolkit import loadgen
    from bench.toolkit import report as rp

    reqs = [
        loadgen.LoadRequest(f"r{i}", i, cls, [1, 2, 3], 3, 5, 0.02 * i)
        for i, cls in enumerate(["ok", "refuse", "fail", "slow", "ok"])
    ]
    run = asyncio.run(loadgen.open_loop(_FakeTarget(), reqs, cutoff_s=0.5))
    # The 'ok' requests' SLO leaves a loaded host's event loop room; 'slow' is judged on a
    # tight one.
    slo = {"slow": (0.2, 0.05)}
    summary = rp.summarize(run.records, 10.0, lambda c: slo.get(c, (2.0, 0.5)), run.wall_s)
    by_id = {r["id"]: r for r in run.records}
    ok = by_id["r0"]
    assert ok["status"] == "finished" and ok["output_tokens"] == 5 and ok["slo_met"]
    # Sleeps never end early; a loaded host only lengthens them: seconds, from the first
    # token and between tokens.
    assert 0.05 <= ok["ttft_s"] < 2.0
    assert 0.01 <= ok["tpot_s"] < 0.5
    assert by_id["r1"]["status"] == "refused" and not by_id["r1"]["slo_met"]
    assert by_id["r2"]["status"] == "error" and "boom" in by_id["r2"]["error"]
    slow = by_id["r3"]
    assert slow["status"] == "cut_off" and slow["output_tokens"] == 1
    assert not slow["could_meet"]  # 4 tokens left, 0.45 s gone: past a 0.05 s TPOT
    assert (
        summary["requests"],
        summary["slo_met"],
        summary["refused"],
        summary["failed"],
        summary["cut_off"],
    ) == (5, 2, 1, 1, 1)
    assert summary["attainment"] == pytest.approx(0.4)
    assert summary["attainment_admitted"] == pytest.approx(0.5)
    assert run.cut_off == 1


def test_goodput_is_the_highest_rate_that_meets_the_target():
    from bench.toolkit import report as rp

    pts = [{"rate": r, "attainment": a} for r, a in ((1, 1.0), (2, 0.95), (3, 0.8), (4, 0.95))]
    g = rp.goodput(pts)
    assert g["rps"] == 4 and g["bound"] == "at_least_highest"
    g = rp.goodput(pts[:3])
    assert g["rps"] == 2 and g["bracket"] == [2, 3]
    assert g["interpolated"] == pytest.approx(2 + (0.95 - 0.9) / (0.95 - 0.8))
    assert rp.goodput([{"rate": 1, "attainment": 0.5}])["rps"] is None


def test_window_rescales_the_trace_to_the_offered_rate(tmp_path):
    from bench.toolkit import workload

    trace = tmp_path / "trace.csv"
    gaps = [0, 1, 3, 4, 8, 9, 10]  # bursts and a lull, in trace seconds
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(
            f"2023-11-16 18:15:{g:02d}.0,{80 * (i + 1)},{16 * (i + 1)}\n"
            for i, g in enumerate(gaps)
        )
    )
    wl = workload.Window(
        trace, 0, 6, workload.Lengths(8, 8, 4, 1024, 2, 128), {"interactive": 0.7, "batch": 0.3}
    )
    # 6 requests over 6 s: the 7th row, 10 trace seconds in, would arrive at 6 s.
    reqs, scale = wl.at_rate(1.0, 6, "t")
    assert scale == pytest.approx(6 / 10)
    assert [r.arrival_s for r in reqs] == pytest.approx([g * 6 / 10 for g in gaps[:6]])
    assert [r.prompt_tokens for r in reqs] == [10 * (i + 1) for i in range(6)]
    assert [r.max_tokens for r in reqs] == [2 * (i + 1) for i in range(6)]
    again, _ = wl.at_rate(2.0, 3, "u")  # the same rows twice as fast keep their prompts
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    assert [r.cls for r in again] == [r.cls for r in reqs]


def test_prefix_workload_turns_resend_the_conversation_and_replays_differ(tmp_path):
    from bench import prefix_cache as pc

    trace = tmp_path / "trace.csv"
    rows = [f"2023-11-16 18:15:{i:02d}.5,{200 + 40 * i},{10 + i}" for i in range(13)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    args = pc.parse_args(
        ["--conversations", "4", "--turns", "3", "--trace", str(trace), "--window-start", "0"]
    )
    first = {r.id: r for r in pc.conversations(args, 1.0, replay=0)}
    assert len(first) == 12
    system = first["c0-t0"].prompt[: pc.SYSTEM_PROMPT_TOKENS]
    for c in range(4):
        turns = [first[f"c{c}-t{k}"] for k in range(3)]
        assert all(t.prompt[: pc.SYSTEM_PROMPT_TOKENS] == system for t in turns)
        for before, after in zip(turns, turns[1:]):
            # The next turn re-sends the last prompt, its answer, then a new message.
            assert after.prompt[: before.prompt_tokens] == before.prompt
            assert after.prompt_tokens > before.prompt_tokens + before.max_tokens
            assert after.arrival_s == before.arrival_s + args.think_s
    second = {r.id: r for r in pc.conversations(args, 1.0, replay=1)}
    assert second["c0-t0"].prompt[:16] != first["c0-t0"].prompt[:16]
    assert [r.prompt_tokens for r in second.values()] == [r.prompt_tokens for r in first.values()]


def _summary(rate: float, overall: float, interactive: float | None = None) -> dict:
    inter = overall if interactive is None else interactive
    return {
        "rate": rate,
        "attainment": overall,
        "per_class": {"interactive": {"attainment": inter}},
    }


def test_rates_extend_past_the_grid_while_the_system_passes():
    cfg = sb.BenchConfig(base_url="x", model="m", tokenizer="t", rates=[1.0, 2.0], extend_rates=2)
    assert sb.next_rate(cfg, [_summary(1, 1.0)]) == 2.0
    assert sb.next_rate(cfg, [_summary(1, 1.0), _summary(2, 0.95)]) == 2.5
    assert sb.next_rate(cfg, [_summary(1, 1.0), _summary(2, 0.5)]) is None
    passing = [_summary(r, 1.0) for r in (1, 2, 2.5, 3.125)]
    assert sb.next_rate(cfg, passing) is None  # two extensions at most
    # The mix: by the interactive class, then one rate at 1.5x the limit found.
    cfg.extend_class, cfg.limit_factor = "interactive", 1.5
    assert sb.next_rate(cfg, [_summary(1, 1.0), _summary(2, 0.5, 0.95)]) == 2.5
    ran = [_summary(1, 1.0), _summary(2, 1.0, 0.95), _summary(2.5, 1.0, 0.8)]
    assert sb.next_rate(cfg, ran) == 3.0
    assert sb.next_rate(cfg, ran + [_summary(3.0, 1.0, 0.5)]) is None
    # 1.5 x 3.993 = 5.9895: the limit rate rounds up, never below 1.5x.
    ran = [_summary(3.993, 1.0, 0.91), _summary(4.991, 1.0, 0.79)]
    assert sb.next_rate(cfg, ran) == 5.99


def test_paired_probes_alternate_which_side_goes_first_and_take_the_median_ratio(monkeypatch):
    import asyncio

    from bench.toolkit import servers as ps

    calls = []
    served = iter([9.0, 10.0, 11.0, 30.0])  # the warm-up, then 3 rounds
    client = iter([0.5, 0.02, 0.03, 0.04])

    async def fake_token_cost(server, streams, tokens, warmup=True):
        calls.append(("served", streams, tokens, warmup))
        return {"ms_per_token": next(served), "client_cores": next(client)}

    class Offline:
        ms = iter([99.0, 10.0, 10.0, 10.0])  # the warm-up, then 3 rounds

        def decode_ms(self, streams, tokens):
            calls.append(("offline", streams, tokens))
            return next(self.ms)

    monkeypatch.setattr(ps, "token_cost", fake_token_cost)
    out = asyncio.run(ps.paired_token_cost(None, Offline(), 8, 96, rounds=3))
    assert [c[0] for c in calls] == [
        "served",
        "offline",
        "offline",
        "served",
        "served",
        "offline",
        "offline",
        "served",
    ]
    assert calls[0][1:] == (8, 8, False) and calls[1][1:] == (8, 8)  # warm-ups, this shape
    assert all(c[1:3] == (8, 96) for c in calls[2:])
    # Ratios 1.0, 1.1, 3.0: the outlier round does not move the median.
    assert out["overhead"] == pytest.approx(0.1)
    assert out["ms_per_token"] == 11.0 and out["offline_ms"] == [10.0, 10.0, 10.0]
    assert out["client_cores"] == 0.03  # the timed rounds' median, not the warm-up's


def _chunk(text: str = "", usage: dict | None = None) -> str:
    import json

    obj = {"choices": [{"index": 0, "text": text}] if text else [], "usage": usage}
    return f"data: {json.dumps(obj)}\n\n"


async def _targets_on(body: str, status: int = 200):
    """Both HTTP targets' token counts against a server answering ``body`` with ``status``:
    (tokens or the error's type, record) for httpx's, then aiohttp's."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from bench.toolkit.loadgen import LoadRequest
    from bench.toolkit.targets import AiohttpTarget, HttpTarget, aiohttp_session, http_client

    async def answer(_request):
        return web.Response(status=status, text=body, content_type="text/event-stream")

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    req = LoadRequest("r", -1, None, "hi", 2, 5)
    results = []
    async with TestServer(app) as server:
        url = str(server.make_url("/v1"))
        async with http_client() as hc, aiohttp_session() as ac:
            for target in (HttpTarget(hc, url, "m"), AiohttpTarget(ac, url, "m")):
                rec: dict = {}
                try:
                    results.append(([n async for n in target.stream(req, rec)], rec))
                except Exception as e:  # noqa: BLE001 - the test compares the types
                    results.append((type(e).__name__, rec))
    return results


def test_both_http_targets_count_tokens_and_fail_alike():
    import asyncio

    from bench.toolkit.loadgen import Refused

    # A chunk per token, then the usage counting two more (a chunk that carried several).
    body = (
        _chunk("a")
        + _chunk("b")
        + _chunk("c")
        + _chunk(
            usage={
                "prompt_tokens": 2,
                "completion_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 1},
            }
        )
        + "data: [DONE]\n\n"
    )
    for tokens, rec in asyncio.run(_targets_on(body)):
        assert tokens == [1, 1, 1, 2]
        assert (rec["server_prompt_tokens"], rec["cached_tokens"]) == (2, 1)
    cut = _chunk("a") + _chunk("b")
    assert [t for t, _ in asyncio.run(_targets_on(cut))] == ["RuntimeError"] * 2
    refused = asyncio.run(_targets_on('{"error": {"message": "busy"}}', status=429))
    assert [t for t, _ in refused] == [Refused.__name__] * 2
    assert [rec["http_status"] for _, rec in refused] == [429, 429]
    error = 'data: {"error": {"message": "replica_lost"}}\n\n'
    assert [t for t, _ in asyncio.run(_targets_on(error))] == ["RuntimeError"] * 2


def test_benchmarks_page_is_what_the_results_render():
    # docs/benchmarks.md is generated from bench/results/*.json: a result rerun, or a
    # suite's report changed, without `python -m bench.docs` fails here.
    from pathlib import Path

    from bench import docs

    page = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
    text = docs.render()
    assert page.read_text() == text
    assert "session" not in text.lower()
    # Every suite's result records its run.
    for suite in docs.SUITES:
        assert f"python -m {suite.module}" in text
    # peers.json records three runs: two windows against vLLM and the packed-weights phase.
    assert text.count("| commit | ") == sum(len(s.results) for s in docs.SUITES) + 2


def test_every_result_file_records_its_run():
    import json
    from pathlib import Path

    from bench import docs

    for suite in docs.SUITES:
        for name in suite.results:
            result = json.loads((docs.RESULTS / name).read_text())
            runs = result["windows"] if "windows" in result else [result]
            for r in runs:
                assert {"date", "commit", "host", "command"} <= set(r["run"]), name
    assert not sorted(
        p.name
        for p in Path(docs.RESULTS).glob("*.json")
        if p.name not in {n for s in docs.SUITES for n in s.results} and "_quick" not in p.name
    ), "a result file no suite renders (smoke runs write *_quick files, never committed)"


async def test_the_in_process_target_admits_as_the_ingress_does():
    # EngineTarget builds its own admission model from the engine's classes and policy.
    import dataclasses
    import time
    from types import SimpleNamespace

    from bench.toolkit.loadgen import LoadRequest, Refused
    from bench.toolkit.targets import EngineTarget
    from policies import DEFAULT_CLASSES, LoadSnapshot, PriorityPolicy

    load = LoadSnapshot(
        max_num_batched_tokens=512,
        max_num_seqs=64,
        num_kv_blocks_free=100_000,
        step_coefficients=(0.05, 0.002, 0.002),
    )
    engine = SimpleNamespace(
        traffic_classes=DEFAULT_CLASSES, scheduler=SimpleNamespace(policy=PriorityPolicy())
    )
    target = EngineTarget(
        SimpleNamespace(engine=engine, load_snapshot=lambda: load), admission=True
    )
    req = LoadRequest("r", 0, "interactive", "hi", prompt_tokens=200, max_tokens=16)
    rec: dict = {}
    await target._admit(req, "interactive", rec, time.perf_counter())
    assert rec["holds"] == 0
    load = dataclasses.replace(
        load, waiting_prefill_tokens={"interactive": 30_000}, waiting_requests={"interactive": 150}
    )
    with pytest.raises(Refused):  # held past the class's max_queue_wait_s (1 s)
        await target._admit(req, "interactive", rec, time.perf_counter() - 5.0)


def test_a_worker_runs_in_its_own_subprocess_and_its_failure_comes_back():
    # bench.engine_throughput runs every worker as `python -m bench.toolkit.workers NAME`:
    # the module path must resolve, and a worker's exception must come back as its result.
    from bench.toolkit import workers

    res = workers.spawn("sweep", {}, {"threads": 1}, timeout=300)
    assert res["error"] == "KeyError: 'gemm_size'", res
    assert "Traceback" in res["traceback"] and "stderr_tail" in res
    assert res["torch_threads"] == 1 and res["peak_rss_mib"] > 0
    assert workers.spawn("nonesuch", {}, {}, timeout=300)["error"].startswith("worker exited")
