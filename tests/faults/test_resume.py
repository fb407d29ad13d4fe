"""A request resumed on another engine with the output it already produced (what
:class:`router.dispatch.RayCall` sends when a replica dies mid-stream) continues that
output exactly: the same tokens and, joined with the text already sent, the same text."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from engine import AsyncLLMEngine, EngineConfig, RequestOutputKind, SamplingParams

PROMPTS = [
    "The capital of France is",
    # Multi-byte characters: a boundary may fall inside one, whose bytes span tokens.
    "Écris une phrase en français avec des accents: é, è, à, ç, et un emoji 🎉",
]


pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    engine = AsyncLLMEngine.from_config(EngineConfig(num_kv_blocks=128))
    yield engine
    await engine.shutdown()


async def _run(engine, prompt, params: dict, resume=(), rid="r") -> tuple[list[int], str, str]:
    sampling = SamplingParams(**params, output_kind=RequestOutputKind.DELTA)
    ids, text, reason = [], [], None
    async for out in engine.generate(prompt, sampling, request_id=rid, resume_token_ids=resume):
        o = out.outputs[0]
        ids += o.token_ids
        text.append(o.text)
        reason = o.finish_reason or reason
    return ids, "".join(text), reason


async def _steps(engine, prompt, params: dict, rid: str) -> list[tuple[list[int], str, str]]:
    """The run's output step by step: ``(token ids, text, finish reason)``."""
    sampling = SamplingParams(**params, output_kind=RequestOutputKind.DELTA)
    return [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
        async for o in engine.generate(prompt, sampling, request_id=rid)
    ]


async def test_greedy_resume_at_any_boundary_equals_the_whole_run(engine):
    # The runs go concurrently, as a replica batches them, to keep the test short.
    params = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    wholes = await asyncio.gather(
        *(_steps(engine, p, params, f"whole{i}") for i, p in enumerate(PROMPTS))
    )
    cases = [(p, steps, k) for p, steps in zip(PROMPTS, wholes) for k in (1, 7, 23)]
    resumed = await asyncio.gather(
        *(
            _run(engine, p, params, [t for ids, _, _ in steps[:k] for t in ids], rid=f"k{i}")
            for i, (p, steps, k) in enumerate(cases)
        )
    )
    for (_, steps, k), (ids, text, reason) in zip(cases, resumed):
        whole_ids = [t for s, _, _ in steps for t in s]
        sent_text = "".join(t for _, t, _ in steps[:k])  # one token per step
        assert whole_ids[:k] + ids == whole_ids, k
        assert sent_text + text == "".join(t for _, t, _ in steps), (k, sent_text, text)
        assert reason == "length"


async def test_resume_honours_stop_strings_and_min_tokens(engine):
    prompt = "Count: one, two, three, four, five, six,"
    base = {"max_tokens": 30, "temperature": 0}
    _, whole_text, _ = await _run(engine, prompt, base, rid="count")
    stop = whole_text[20:26]  # a stop string the whole run reaches later
    params = {**base, "stop": [stop], "min_tokens": 2}
    steps = await _steps(engine, prompt, params, "stopped")
    ids = [t for s, _, _ in steps for t in s]
    text = "".join(t for _, t, _ in steps)
    assert steps[-1][2] == "stop" and stop not in text and len(ids) > 4
    ks = sorted({1, 2, len(ids) // 2})
    resumed = await asyncio.gather(
        *(_run(engine, prompt, params, ids[:k], rid=f"s{k}") for k in ks)
    )
    for k, (more_ids, more_text, reason) in zip(ks, resumed):
        sent = "".join(t for _, t, _ in steps[:k])  # held-back text not sent yet
        assert ids[:k] + more_ids == ids and reason == "stop", k
        assert sent + more_text == text, (k, sent, more_text)


async def test_resume_is_refused_when_nothing_is_left(engine):
    with pytest.raises(ValueError, match="leave none"):
        await _run(engine, "Hi", {"max_tokens": 2}, [1, 2])
    with pytest.raises(ValueError, match="n == 1"):
        await _run(engine, "Hi", {"max_tokens": 4, "n": 2}, [1])
