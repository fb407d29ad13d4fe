"""Failures inside the engine stay local: an exception in one request's work (a logits
processor, its grammar matcher, its detokenizer) fails that request alone, an exception in
a step's run fails that step's requests, and the engine goes on; an engine that cannot go
on (steps failing again and again, its worker thread gone) answers ``/health`` with 503.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import httpx
import pytest

from deploy.engine_replica import engine_items
from engine import (
    AsyncLLMEngine,
    EngineConfig,
    EngineDeadError,
    LLMEngine,
    RequestFailedError,
    RequestOutputKind,
    SamplingParams,
)
from engine.llm_engine import MAX_FAILED_STEPS, EngineBrokenError
from engine.model import logits_processors
from engine.model.detokenizer import IncrementalDetokenizer
from router.contract import ModelInfo, RequestShape, StepItem
from router.dispatch import RayCall
from router.errors import ApiError
from router.ingress import Ingress, add_routes, make_app
from router.local import LocalReplicas
from router.step_streams import StepStreams
from tests.faults.conftest import GREEDY, LocalServer, Streamed, fault_config, stream
from tests.serving_app import MODEL
from tests.test_engine_seams import CostModelRunner, FakeClock, FakeTokenizer
from tests.test_step_streams import FakeReplicas, item

pytestmark = pytest.mark.slow

MARK_PENALTY = 0.125
"""The presence penalty that marks the request whose logits processor raises."""
MARK_STOP = "@@fail@@"
"""The stop string that marks the request whose detokenizer raises."""


def _fanout(calls: list) -> list:
    """Run the thunks ``calls`` at once (a thread each); their results in order."""
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def _check_failed_stream(s: Streamed, exception: str) -> None:
    """A stream that failed in the engine: an OpenAI error event naming ``exception``,
    then ``[DONE]``, and no finish reason (it did not finish)."""
    assert s.status == 200 and s.done, s
    assert len(s.errors) == 1, s.events
    err = s.errors[0]
    assert err["code"] == "request_failed" and err["type"] == "service_unavailable_error"
    assert exception in err["message"], err
    assert s.finish_reasons == []


def _check_failed_response(r: httpx.Response, exception: str) -> None:
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "request_failed" and exception in err["message"], err


def _check_recovered(server: LocalServer, greedy_text: str) -> None:
    """The engine went on: idle (gauges 0, every KV block free), alive, healthy, and a new
    greedy request gets the answer it got before any fault."""
    server.wait_idle()
    assert not server.engine.dead
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    r = server.complete()
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy_text
    server.wait_idle()


def test_a_raising_logits_processor_fails_only_its_request(
    fault_server: LocalServer, greedy_text: str, monkeypatch
):
    real = logits_processors._process_row

    def flaky(row, req, eos_token_ids):
        if req.params.presence_penalty == MARK_PENALTY:
            raise RuntimeError("injected: a logits processor")
        real(row, req, eos_token_ids)

    monkeypatch.setattr(logits_processors, "_process_row", flaky)
    marked = {**GREEDY, "presence_penalty": MARK_PENALTY}
    # A penalised neighbour whose processors work: only the marked row fails.
    penalised = {**GREEDY, "presence_penalty": 0.5}
    results = _fanout(
        [
            lambda: stream(fault_server, marked),
            lambda: fault_server.complete(marked),
            lambda: stream(fault_server, GREEDY),
            lambda: fault_server.complete(),
            lambda: fault_server.complete(penalised),
        ]
    )
    _check_failed_stream(results[0], "RuntimeError: injected: a logits processor")
    _check_failed_response(results[1], "RuntimeError: injected: a logits processor")
    assert results[2].text == greedy_text and results[2].finish_reasons == ["length"]
    assert results[3].status_code == 200 and results[3].json()["choices"][0]["text"] == greedy_text
    assert results[4].status_code == 200, results[4].text
    _check_recovered(fault_server, greedy_text)


def test_a_grammar_matcher_error_fails_only_its_request(
    fault_server: LocalServer, greedy_text: str, monkeypatch
):
    structured = fault_server.engine.engine.structured
    real = structured.for_params

    class Flaky:
        """A real matcher that raises once the request has a few tokens."""

        def __init__(self, inner: Any) -> None:
            self.inner, self.fills = inner, 0

        def fill_next_token_bitmask(self, bitmask, index: int) -> None:
            self.fills += 1
            if self.fills > 3:
                raise RuntimeError("injected: a grammar matcher")
            self.inner.fill_next_token_bitmask(bitmask, index)

        def accept_token(self, token_id: int) -> bool:
            return self.inner.accept_token(token_id)

    def flaky(params: Any) -> Flaky | None:
        inner = real(params)
        return None if inner is None else Flaky(inner)

    monkeypatch.setattr(structured, "for_params", flaky)
    chat = {
        "model": MODEL,
        "max_tokens": 32,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Name a city."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "city",
                "schema": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        },
    }
    results = _fanout(
        [
            lambda: stream(fault_server, chat, "/v1/chat/completions"),
            lambda: fault_server.post("/v1/chat/completions", chat),
            lambda: stream(fault_server, GREEDY),
        ]
    )
    _check_failed_stream(results[0], "RuntimeError: injected: a grammar matcher")
    assert results[0].text.startswith("{")  # it streamed its first tokens, then failed
    _check_failed_response(results[1], "RuntimeError: injected: a grammar matcher")
    assert results[2].text == greedy_text and results[2].finish_reasons == ["length"]
    _check_recovered(fault_server, greedy_text)


def test_a_detokenizer_failure_fails_only_its_request(
    fault_server: LocalServer, greedy_text: str, monkeypatch
):
    real = IncrementalDetokenizer.update

    def flaky(self, new_token_ids, check_stop=True):
        if MARK_STOP in self._stop and len(self._token_ids) >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected: a tokenizer")
        return real(self, new_token_ids, check_stop)

    monkeypatch.setattr(IncrementalDetokenizer, "update", flaky)
    marked = {**GREEDY, "stop": [MARK_STOP]}
    results = _fanout(
        [
            lambda: stream(fault_server, marked),
            lambda: fault_server.complete(marked),
            lambda: stream(fault_server, GREEDY),
            lambda: fault_server.complete(),
        ]
    )
    _check_failed_stream(results[0], "UnicodeDecodeError")
    assert results[0].text  # three tokens streamed before the fourth failed
    _check_failed_response(results[1], "UnicodeDecodeError")
    assert results[2].text == greedy_text and results[2].finish_reasons == ["length"]
    assert results[3].status_code == 200 and results[3].json()["choices"][0]["text"] == greedy_text
    _check_recovered(fault_server, greedy_text)


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(
    fault_server: LocalServer, greedy_text: str, monkeypatch
):
    runner = fault_server.engine.engine.runner
    real, calls = runner.execute, []

    def once(out):
        calls.append(out)
        if len(calls) == 1:
            raise RuntimeError("injected: the forward")
        return real(out)

    monkeypatch.setattr(runner, "execute", once)
    _check_failed_response(fault_server.complete(), "RuntimeError: injected: the forward")
    _check_recovered(fault_server, greedy_text)
    assert len(calls) > 1


# -- an engine that cannot go on ---------------------------------------------------------


def _fake_engine() -> AsyncLLMEngine:
    """An async engine over a fake runner and clock (no model)."""
    clock = FakeClock()
    config = EngineConfig(block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    return AsyncLLMEngine(
        LLMEngine(config, runner=CostModelRunner(clock), tokenizer=FakeTokenizer(), clock=clock)
    )


class _Replica:
    """A :class:`router.local.LocalReplica` over a fake engine, with a real tokenizer."""

    replica_id = "fake"

    def __init__(self, engine: AsyncLLMEngine, tokenizer) -> None:
        self.engine, self.tokenizer = engine, tokenizer

    def info(self) -> ModelInfo:
        return ModelInfo(self.tokenizer, self.engine.engine.limits)

    def items(self, request_id, prompt_token_ids, params, shape, send_load=True):
        return engine_items(
            self.engine, self.replica_id, request_id, prompt_token_ids, params, shape, send_load
        )

    def record_routing_stats(self) -> dict[str, Any]:
        return {**self.engine.load_snapshot().to_dict(), "metrics": {}}


async def _consume(engine: AsyncLLMEngine, n: int = 1) -> list:
    params = SamplingParams(max_tokens=20, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    return [o async for o in engine.generate(list(range(1, n + 5)), params)]


async def test_failing_steps_in_a_row_kill_the_engine_and_health_says_503(
    fault_server: LocalServer,
):
    engine = _fake_engine()
    ingress = Ingress(
        LocalReplicas(_Replica(engine, fault_server.engine.engine.tokenizer)),
        fault_config().ingress_settings().model_dump(),
    )
    app = make_app()
    add_routes(app, ingress)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://fault"
    ) as client:
        try:
            assert (await client.get("/health")).status_code == 200
            assert (await _consume(engine))[-1].finished
            # One failed step fails its request; the next step runs.
            runner, real, calls = engine.engine.runner, engine.engine.runner.execute, []

            def failing(out, fail_first: int = 1):
                calls.append(out)
                if len(calls) <= fail_first:
                    raise RuntimeError("injected: the forward")
                return real(out)

            runner.execute = failing
            with pytest.raises(RequestFailedError, match="injected: the forward"):
                await _consume(engine)
            assert (await _consume(engine))[-1].finished and not engine.dead
            assert (await client.get("/health")).status_code == 200
            # Steps that fail whatever they hold: the engine is lost at the
            # MAX_FAILED_STEPS-th in a row (each request alone is one step).
            runner.execute = lambda out: failing(out, fail_first=10**9)
            for _ in range(MAX_FAILED_STEPS - 1):
                with pytest.raises(RequestFailedError):
                    await asyncio.wait_for(_consume(engine), 30)
                assert not engine.dead
            with pytest.raises(EngineDeadError) as dead:
                await asyncio.wait_for(_consume(engine), 30)
            assert isinstance(dead.value.__cause__, EngineBrokenError)
            assert engine.dead
            r = await client.get("/health")
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
            r = await client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                headers={"Authorization": "Bearer sk-standard"},
            )
            assert r.status_code == 503, r.text
        finally:
            await engine.shutdown()


async def test_a_worker_thread_gone_without_an_error_is_a_dead_engine():
    # The batching loop leaves on an exception that is not an Exception (SystemExit).
    engine = _fake_engine()
    try:

        def leave(out):
            raise SystemExit("injected: the worker thread ends")

        engine.engine.runner.execute = leave
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_consume(engine), 30)
        assert engine.dead
        assert LocalReplicas(_Replica(engine, None)).count() == 0
    finally:
        await engine.shutdown()
    # The worker's executor shut down underneath the engine: nothing can step it.
    engine = _fake_engine()
    try:
        assert (await _consume(engine))[-1].finished and not engine.dead
        engine._executor.shutdown(wait=True)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_consume(engine), 30)
        assert engine.dead
        assert LocalReplicas(_Replica(engine, None)).count() == 0
    finally:
        await engine.shutdown()


async def test_on_ray_serve_a_failed_request_is_a_503_request_failed_not_a_lost_replica():
    # The replica puts the failed request's last item on its step stream (as any item);
    # the ingress's call answers 503 request_failed and re-sends nothing.
    handle = FakeReplicas(["r1", "r2"])
    shape = RequestShape(1, "standard", 1)
    call = RayCall(handle, "req", [1], SamplingParams(), shape, StepStreams(handle))
    await call.start()
    await asyncio.sleep(0)
    items = call.items()
    handle.streams["r1"].fed.put_nowait([("req", item("t"))])
    assert (await items.__anext__()).outputs[0].text == "t"
    failed = StepItem([], True, error="RuntimeError: injected")
    handle.streams["r1"].fed.put_nowait([("req", failed)])
    with pytest.raises(ApiError) as e:
        await asyncio.wait_for(items.__anext__(), 10)
    assert (e.value.status, e.value.code) == (503, "request_failed")
    assert "RuntimeError: injected" in e.value.message
    assert call.attempts == 1 and call.replica == "r1" and call.done
