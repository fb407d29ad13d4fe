"""The step log (engine/core/step_log.py): its format, what the real engine records in it,
``GET /steps``, and the replay of a small recorded log through the simulator, matched
step for step (deploy/sim/replay.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from deploy.config import ServiceConfig
from deploy.sim.calibrate import fit_log
from deploy.sim.replay import BARS, compare, replay, service_config
from engine import EngineConfig, LLMEngine, RequestOutputKind, SamplingParams
from engine.core.interfaces import FinishRecord, StepRecord
from engine.core.step_log import IDLE_GAP_S, VERSION, StepLog, StepRecorder, engine_info

SMALL_LOG = Path(__file__).parent / "data" / "step_log_small.jsonl"
INFO = {"model": "m", "num_kv_blocks": 10, "block_size": 16, "max_model_len": 64}

STEP_FIELDS = {
    "type": str,
    "i": int,
    "t": float,
    "dur": float,
    "sched": float,
    "tok": float,
    "pred": (float, type(None)),
    "decodes": int,
    "prefill": int,
    "waiting": int,
    "running": int,
    "seqs": list,
    "preempted": list,
    "cap": (float, int, type(None)),
    "owed": (float, int, type(None)),
    "sat_out": list,
    "shed": list,
}
EVENT_FIELDS = {
    "arrival": {
        "type": str,
        "t": float,
        "id": str,
        "class": str,
        "priority": int,
        "prompt_tokens": int,
        "max_tokens": (int, type(None)),
    },
    "admit": {"type": str, "t": float, "id": str, "held_s": float},
    "refuse": {"type": str, "t": float, "id": str, "reason": str},
    "finish": {
        "type": str,
        "t": float,
        "id": str,
        "class": str,
        "priority": int,
        "prompt_tokens": int,
        "max_tokens": int,
        "output_tokens": int,
        "engine_arrival": float,
        "first_token": (float, type(None)),
        "reason": str,
    },
}


def step(i: int, start: float, seconds: float, seqs, **more) -> StepRecord:
    decodes = sum(1 for s in seqs if s[2] == 1 and s[1] > 0)
    fields = dict(
        index=i,
        start=start,
        seconds=seconds,
        schedule_s=0.0001,
        tokens_at=seconds * 0.9,
        phases=(("forward", seconds / 2),),
        predicted_s=seconds,
        num_decodes=decodes,
        num_prefill_tokens=sum(s[2] for s in seqs) - decodes,
        num_waiting=0,
        num_running=len(seqs),
        seqs=tuple(seqs),
        preempted=(),
        prefill_cap=float("inf"),
        owed_cap=float("inf"),
        sat_out=(),
        shed=(),
    )
    return StepRecord(**{**fields, **more})


def finish(rid: str, arrival: float, first: float | None, end: float, n: int, **more):
    fields = dict(
        request_id=rid,
        traffic_class="standard",
        priority=1,
        prompt_tokens=20,
        max_tokens=8,
        output_tokens=n,
        arrival=arrival,
        first_token=first,
        finish=end,
        reason="length",
    )
    return FinishRecord(**{**fields, **more})


def record_synthetic(rec: StepRecorder) -> None:
    """``a`` runs alone, the engine idles, ``b`` (held by admission) joins ``a``; ``c``
    is refused; ``d`` came to the engine directly (no ingress events)."""
    rec.arrival("a", 1.0, "standard", 1, 20, 8)
    rec.admitted("a", 1.001, 0.001)
    rec.step(step(0, 1.002, 0.010, [("a", 0, 20)]))
    rec.step(step(1, 1.015, 0.005, [("a", 20, 1)], prefill_cap=300.0, owed_cap=250.0))
    rec.arrival("b", 1.4, "batch", 2, 10, None)
    rec.admitted("b", 1.45, 0.05)
    rec.step(step(2, 1.5, 0.012, [("a", 21, 1), ("b", 0, 10)], sat_out=("x",)))
    rec.finish(finish("a", 1.0015, 1.011, 1.512, 3))
    rec.arrival("c", 1.6, "standard", 1, 30, 4)
    rec.refused("c", 1.601, "server busy")
    rec.step(step(3, 1.7, 0.004, [("d", 0, 8)], predicted_s=float("nan")))
    rec.finish(finish("b", 1.45, 1.512, 1.7, 1, traffic_class="batch", priority=2))
    rec.finish(finish("d", 1.69, 1.704, 1.704, 1, reason="stop"))


def test_recorder_writes_the_documented_records(tmp_path):
    path = tmp_path / "log.jsonl"
    rec = StepRecorder(INFO, path)
    record_synthetic(rec)
    rec.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"type": "header", "version": VERSION, "engine": INFO}
    assert [r["type"] for r in lines[1:]].count("step") == 4
    for r in lines[1:]:
        fields = STEP_FIELDS if r["type"] == "step" else EVENT_FIELDS[r["type"]]
        assert set(r) == set(fields), r
        for name, types in fields.items():
            assert isinstance(r[name], types) and not isinstance(r[name], bool), (name, r)
        if r["type"] == "step":
            assert all(len(s) == 3 for s in r["seqs"])
    steps = [r for r in lines if r["type"] == "step"]
    # Infinite caps (no guard plan) and a NaN prediction are JSON null, not Infinity/NaN.
    assert steps[0]["cap"] is None and steps[1]["cap"] == 300.0 and steps[1]["owed"] == 250.0
    assert steps[3]["pred"] is None and steps[2]["sat_out"] == ["x"]
    assert "Infinity" not in path.read_text() and "NaN" not in path.read_text()


def test_read_joins_events_and_gives_periods_and_kinds(tmp_path):
    path = tmp_path / "log.jsonl"
    rec = StepRecorder(INFO, path)
    record_synthetic(rec)
    rec.close()
    log = StepLog.read(path)
    assert log.engine == INFO
    s0, s1, s2, s3 = log.steps
    # 3 ms between steps 0 and 1 is the loop's own time: counted into step 0's period.
    assert s0.period == pytest.approx(1.015 - 1.002)
    assert 1.5 - (1.015 + 0.005) > IDLE_GAP_S  # idleness after step 1: not counted
    assert s1.period == pytest.approx(0.005) and s3.period == pytest.approx(0.004)
    assert [s.kind for s in log.steps] == ["prefill", "decode", "mixed", "prefill"]
    assert s2.composition == (("a", 21, 1), ("b", 0, 10))
    assert s1.cap == 300.0 and s0.cap is None and s2.sat_out == ("x",)
    assert {k: [s.index for s in v] for k, v in log.kinds().items()} == {
        "decode": [1],
        "mixed": [2],
        "prefill": [0, 3],
    }
    assert list(log.requests) == ["a", "b", "c", "d"]  # by arrival
    a, b, c, d = log.requests.values()
    assert (a.arrival, a.admitted, a.engine_arrival, a.first_token, a.finish) == (
        1.0,
        1.001,
        1.0015,
        1.011,
        1.512,
    )
    assert a.ttft_s == pytest.approx(0.011) and a.tpot_s == pytest.approx((1.512 - 1.011) / 2)
    assert a.output_tokens == 3 and a.finish_reason == "length" and a.priority == 1
    assert b.traffic_class == "batch" and b.priority == 2 and b.admitted == 1.45
    assert b.max_tokens == 8  # the arrival's null filled from the finish record
    assert b.tpot_s is None  # one token: no time per output token
    assert c.refused == 1.601 and c.reason == "server busy" and c.finish is None
    assert c.ttft_s is None and c.admitted is None
    assert d.arrival == d.engine_arrival == 1.69 and d.finish_reason == "stop"


def test_a_file_appended_by_two_runs_keeps_the_last(tmp_path):
    path = tmp_path / "log.jsonl"
    first = StepRecorder(INFO, path)
    record_synthetic(first)
    first.close()
    second = StepRecorder({**INFO, "num_kv_blocks": 99}, path)
    second.arrival("z", 5.0, "standard", 1, 4, 2)
    second.step(step(0, 5.001, 0.01, [("z", 0, 4)]))
    second.close()
    assert path.read_text().count('"header"') == 2
    log = StepLog.read(path)
    assert log.engine["num_kv_blocks"] == 99
    assert list(log.requests) == ["z"] and [s.start for s in log.steps] == [5.001]


@pytest.mark.parametrize(
    "records, message",
    [
        ([], "no header"),
        ([{"type": "step", "i": 0}], "no header"),
        ([{"type": "header", "version": VERSION + 1, "engine": {}}], "version"),
        ([{"type": "header", "version": VERSION, "engine": {}}, [1, 2]], "not a step-log"),
        ([{"type": "header", "version": VERSION, "engine": {}}, {"t": 1}], "not a step-log"),
        (
            [{"type": "header", "version": VERSION, "engine": {}}, {"type": "step", "i": 0}],
            "malformed step-log record",
        ),
        (
            [
                {"type": "header", "version": VERSION, "engine": {}},
                {"type": "arrival", "t": 1.0, "id": "a"},
            ],
            "malformed step-log record",
        ),
    ],
)
def test_bad_input_is_a_clear_value_error(records, message):
    with pytest.raises(ValueError, match=message):
        StepLog.parse(records)


def test_a_file_that_is_not_json_lines_is_a_value_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"type": "header", "version": 1, "engine": {}}\nnot json\n')
    with pytest.raises(ValueError, match="not JSON lines"):
        StepLog.read(path)


def test_recent_filters_by_time_and_keeps_history_records():
    rec = StepRecorder(INFO, None, history=3)
    for k in range(5):
        rec.arrival(f"r{k}", float(k), "standard", 1, 4, 2)
    header, *kept = rec.recent()
    assert header == {"type": "header", "version": VERSION, "engine": INFO}
    assert [r["id"] for r in kept] == ["r2", "r3", "r4"]
    assert [r["id"] for r in rec.recent(since=3.0)[1:]] == ["r3", "r4"]
    assert rec.recent(since=10.0) == [header]
    assert StepRecorder(INFO, None, history=0).recent() == [header]


# -- the real engine ----------------------------------------------------------------------


def test_the_real_engine_records_every_step_and_finish(prompts):
    engine = LLMEngine.from_config(EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64))
    rec = StepRecorder(engine_info(engine), None)
    rec.attach(engine)
    final = SamplingParams(max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    asks = {
        "one": (prompts[10], final),  # 45 tokens
        "chunked": (prompts[14], dataclasses.replace(final, max_tokens=4)),  # 170: 3 chunks
        "two": (prompts[8], dataclasses.replace(final, n=2, max_tokens=3)),
        "aborted": (prompts[12], dataclasses.replace(final, max_tokens=50)),
    }
    for rid, (prompt, params) in asks.items():
        engine.add_request(rid, prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        if len([r for r in rec.recent() if r.get("type") == "step"]) == 8 and not outs.get(
            "aborted"
        ):
            outs.update({o.request_id: o for o in engine.abort("aborted")})
    finishes = [r for r in rec.recent() if r["type"] == "finish"]
    assert sorted(f["id"] for f in finishes) == sorted(asks)  # one each
    for f in finishes:
        out = outs[f["id"]]
        assert out.finished
        assert f["output_tokens"] == max(len(c.token_ids) for c in out.outputs)
        assert f["engine_arrival"] == out.metrics.arrival_time
        assert f["first_token"] == out.metrics.first_token_time
        assert f["prompt_tokens"] == len(asks[f["id"]][0])
        assert f["reason"] == ("abort" if f["id"] == "aborted" else "length")
    steps = [r for r in rec.recent() if r["type"] == "step"]
    assert [s["i"] for s in steps] == list(range(len(steps)))
    assert not any(s["preempted"] for s in steps)
    # Each sequence's chunks are contiguous, from its first uncached position to its
    # prompt plus output tokens less the last sampled one (never fed back; the aborted
    # one was aborted between steps). Without a cached prefix, the tokens it computed sum
    # to exactly that.
    spans: dict[str, list[tuple[int, int]]] = {}
    for s in steps:
        assert s["decodes"] + s["prefill"] == sum(n for _, _, n in s["seqs"])
        for sid, start, n in s["seqs"]:
            spans.setdefault(sid, []).append((start, n))
    want_ids = {"one", "chunked", "two#0", "two#1", "aborted"}
    assert set(spans) == want_ids
    for sid, chunks in spans.items():
        rid = sid.split("#")[0]
        out = outs[rid]
        made = len(out.outputs[int(sid.split("#")[1]) if "#" in sid else 0].token_ids)
        for (s0, n0), (s1, _) in zip(chunks, chunks[1:]):
            assert s1 == s0 + n0, sid
        assert chunks[-1][0] + chunks[-1][1] == len(asks[rid][0]) + made - 1, sid
        if sid != "two#1":  # the second of n=2 may reuse the first's cached blocks
            assert chunks[0][0] == 0, sid
    # The engine's clock: the log reads back with one request per finish.
    log = StepLog.parse(rec.recent())
    assert len(log.steps) == len(steps) and set(log.requests) == set(asks)


# -- GET /steps -------------------------------------------------------------------------------

KEY = "sk-steps"


def local_app(**config):
    from deploy.local_server import build_local

    server, replica = build_local(
        ServiceConfig(
            api_keys={KEY: {"tenant": "t", "traffic_class": "standard"}},
            engine={"num_kv_blocks": 64},
            **config,
        )
    )
    return server.config.app, replica


async def test_steps_endpoint_serves_the_step_log():
    app, replica = local_app()
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/steps")).status_code == 401
            resp = await client.get("/steps", headers=auth)
            assert resp.status_code == 200
            assert resp.json()["records"][0]["type"] == "header"
            assert resp.json()["records"][0]["version"] == VERSION
            done = await client.post(
                "/v1/completions",
                headers=auth,
                json={"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 3},
            )
            assert done.status_code == 200
            rid = done.json()["id"]
            assert done.headers["x-request-id"] == rid
            records = (await client.get("/steps?seconds=60", headers=auth)).json()["records"]
            mine = {r["type"] for r in records if r.get("id") == rid}
            assert mine == {"arrival", "admit", "finish"}
            assert any(rid in {s[0] for s in r["seqs"]} for r in records if r["type"] == "step")
            log = StepLog.parse(records)
            assert log.requests[rid].output_tokens == 3
            assert log.requests[rid].admitted is not None
            for bad in ("abc", "-1", "nan"):
                resp = await client.get(f"/steps?seconds={bad}", headers=auth)
                assert resp.status_code == 400, bad
                error = resp.json()["error"]
                assert error["param"] == "seconds" and error["code"] == "invalid_value"
                assert error["type"] == "invalid_request_error" and bad in error["message"]
    finally:
        await replica.engine.shutdown()


async def test_steps_endpoint_is_404_without_history():
    app, replica = local_app(step_history=0)
    try:
        assert replica.recorder is None
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            resp = await client.get("/steps", headers={"Authorization": f"Bearer {KEY}"})
            assert resp.status_code == 404
            assert resp.json()["error"]["code"] == "not_found"
    finally:
        await replica.engine.shutdown()


def test_a_step_log_needs_one_replica():
    with pytest.raises(ValidationError, match="num_replicas: 1"):
        ServiceConfig(step_log="x", num_replicas=2)
    assert ServiceConfig(step_log="x").step_log == "x"


# -- the replay of a recorded log ---------------------------------------------------------


def test_the_recorded_log_replays_step_for_step():
    """tests/data/step_log_small.jsonl (recorded by tests/data/record_step_log.py through
    ``iterserve serve --step-log``) replays with every step's composition the same."""
    log = StepLog.read(SMALL_LOG)
    assert len(log.requests) >= 12 and {r.traffic_class for r in log.requests.values()} == {
        "standard",
        "batch",
    }
    assert all(r.admitted is not None for r in log.requests.values())
    assert max(len(s.seqs) for s in log.steps) >= 2  # it batched
    rep = replay(log, service_config(log))
    report = compare(log, rep)
    assert report["divergence"] is None, report["divergence"]
    assert report["status_differs"] == []
    assert report["steps"]["unmatched"] == report["steps"]["near"] == 0
    assert report["steps"]["matched"] == report["steps"]["real"] == len(log.steps)
    for metric in ("ttft", "tpot"):
        assert report[metric]["compared"] == len(log.requests)
        assert report[metric]["median_abs"] <= BARS["median"], report[metric]
        assert report[metric]["p99_abs"] <= BARS["p99"], report[metric]
    assert report["within_bars"] == {"median": True, "p99": True}


def test_a_perturbed_log_diverges_at_the_changed_step():
    log = StepLog.read(SMALL_LOG)
    # The first step that batched two requests: one of them computes one token less.
    k = next(i for i, s in enumerate(log.steps) if len(s.seqs) >= 2 and s.num_prefill_tokens)
    s = log.steps[k]
    rid, start, n = next(x for x in s.seqs if x[2] > 1)
    seqs = tuple((a, b, c - 1 if a == rid else c) for a, b, c in s.seqs)
    log.steps[k] = dataclasses.replace(s, seqs=seqs, num_prefill_tokens=s.num_prefill_tokens - 1)
    div = compare(log, replay(log, service_config(log)))["divergence"]
    assert div is not None and div["step"] == k and div["why"]

    # A step dropped: the next real step is compared with the replay's dropped one.
    log = StepLog.read(SMALL_LOG)
    j = len(log.steps) // 2
    del log.steps[j]
    div = compare(log, replay(log, service_config(log)))["divergence"]
    assert div is not None and div["step"] == j and div["why"]


def test_a_request_arriving_before_the_first_step_after_idleness_joins_it():
    """The time outside steps after idleness (the ingress's work on the waking request,
    the loop's wake-up) is spent before the simulated step is scheduled, as before the
    real one: a request that arrived meanwhile is in that first step in both runs."""
    small = StepLog.read(SMALL_LOG)
    rec = StepRecorder(small.engine, None)
    rec.arrival("r1", 10.0, "standard", 1, 30, 3)
    rec.admitted("r1", 10.0015, 0.0015)
    rec.arrival("r2", 10.001, "standard", 1, 80, 3)
    rec.admitted("r2", 10.0018, 0.0008)
    t, seqs = 10.0025, [("r1", 0, 30), ("r2", 0, 80)]
    for i, dur in enumerate((0.05, 0.03, 0.03)):
        rec.step(step(i, t, dur, seqs))
        t += dur + 0.0005
        seqs = [(rid, pos + n, 1) for rid, pos, n in seqs]
    first = 10.0025 + 0.05 * 0.9
    for rid, prompt in (("r1", 30), ("r2", 80)):
        end = 10.0025 + 0.05 + 0.0005 + 0.03 + 0.0005 + 0.03 * 0.9
        rec.finish(finish(rid, 10.0018, first, end, 3, prompt_tokens=prompt, max_tokens=3))
    log = StepLog.parse(rec.recent())
    # Three steps are too few to fit a fallback on; none is used.
    report = compare(log, replay(log, service_config(log), fallback=fit_log(small)))
    assert report["divergence"] is None, report["divergence"]
    assert report["steps"] == {"real": 3, "simulated": 3, "matched": 3, "near": 0, "unmatched": 0}
    assert report["ttft"]["median_abs"] == pytest.approx(0.0, abs=1e-9)
    assert report["tpot"]["p99_abs"] == pytest.approx(0.0, abs=1e-9)
