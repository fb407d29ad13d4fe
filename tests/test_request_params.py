"""A request's way in: the router builds its ``SamplingParams`` once, without torch; they
cross to the replica as they are, and the engine checks the request once."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from engine.core.params import ParamError, RequestOutputKind
from tests.test_engine_seams import CostModelRunner, FakeClock, FakeTokenizer

ROOT = Path(__file__).resolve().parents[1]

ROUTER_MODULES = (
    "engine.core.params",
    "router.contract",
    "router.openai_format",
    "router.ingress",
    "router.local",
    "router.dispatch",
)


def test_the_router_and_the_params_import_no_torch():
    code = "import sys\n" + "".join(f"import {m}\n" for m in ROUTER_MODULES)
    code += "print('torch' in sys.modules)\n"
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == "False", out.stderr


def test_params_cross_a_pickle_as_they_are_without_a_second_check(monkeypatch):
    params = SamplingParams(  # every field off its default
        max_tokens=8,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logit_bias={5: -1.0},
        min_tokens=2,
        json_schema={"type": "object"},
        seed=3,
        stop=["\n"],
        stop_token_ids=[7],
        n=2,
        logprobs=1,
        prompt_logprobs=0,
        output_kind=RequestOutputKind.DELTA,
    )
    assert (
        sum(getattr(params, f.name) != getattr(SamplingParams(), f.name) for f in fields(params))
        == len(fields(params)) - 2
    )  # all but ignore_eos and structural_tag, which a json_schema excludes
    tagged = SamplingParams(structural_tag={"type": "structural_tag", "format": {"type": "x"}})
    assert pickle.loads(pickle.dumps(tagged, protocol=5)) == tagged
    wire = pickle.dumps(params, protocol=5)
    assert copy.deepcopy(params) == params

    def checked_again(self):
        raise AssertionError("unpickling ran SamplingParams' checks")

    monkeypatch.setattr(SamplingParams, "__post_init__", checked_again)
    assert pickle.loads(wire) == params


def test_params_are_checked_where_they_are_built():
    with pytest.raises(ParamError) as e:
        SamplingParams(max_tokens=2, min_tokens=3)
    assert e.value.param == "min_tokens"


def _engine() -> LLMEngine:
    clock = FakeClock()
    config = EngineConfig(block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    return LLMEngine(config, runner=CostModelRunner(clock), tokenizer=FakeTokenizer(), clock=clock)


def _count_checks(monkeypatch, engine: LLMEngine) -> dict[str, int]:
    counts = {"validate": 0, "check_resume": 0}
    for name in counts:
        real = getattr(engine, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(engine, name, counted)
    return counts


def test_add_request_checks_a_request_once(monkeypatch):
    engine = _engine()
    counts = _count_checks(monkeypatch, engine)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4), resume_token_ids=[7])
    assert counts == {"validate": 1, "check_resume": 1}
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad", [1, 10**6], SamplingParams())


async def test_the_async_engine_checks_a_request_once_before_its_stream_starts(monkeypatch):
    engine = _engine()
    counts = _count_checks(monkeypatch, engine)
    aengine = AsyncLLMEngine(engine)
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        outs = [o async for o in aengine.generate([1, 2, 3], params, resume_token_ids=[7])]
        assert outs[-1].finished
        # Checked on the event loop (submit); the worker added it without a second check.
        assert counts == {"validate": 1, "check_resume": 1}
        with pytest.raises(ValueError, match="outside the vocabulary"):
            aengine.submit([1, 10**6], params)
        assert aengine.num_unfinished == 0
    finally:
        await aengine.shutdown()
