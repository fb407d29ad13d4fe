"""Engine behaviour on the real default model: refusal, abort, seeds, stops, async streams."""

from __future__ import annotations

import asyncio

import pytest

from engine import (
    LLM,
    AsyncLLMEngine,
    EngineConfig,
    RequestOutputKind,
    RequestRejectedError,
    SamplingParams,
)
from engine.llm import OFFLINE_MAX_NUM_BATCHED_TOKENS, OFFLINE_MAX_NUM_SEQS
from engine.model.loader import ModelLoadError, load_model


@pytest.fixture(scope="module")
def llm():
    # 40 blocks of 16 tokens: a 640-token KV cache, small enough to test refusal.
    return LLM(num_kv_blocks=40, max_num_seqs=8)


def all_blocks_free(llm) -> bool:
    bm = llm.llm_engine.block_manager
    bm.check()
    return bm.num_free_blocks == bm.num_blocks


def test_offline_generate_default_prompt(llm):
    # The offline class takes the larger offline budget; the engine's own stays the server's.
    assert llm.llm_engine.config.max_num_batched_tokens == OFFLINE_MAX_NUM_BATCHED_TOKENS
    assert EngineConfig().max_num_batched_tokens < OFFLINE_MAX_NUM_BATCHED_TOKENS
    assert llm.llm_engine.config.max_num_seqs == 8  # given, so the offline 128 does not apply
    assert EngineConfig().max_num_seqs < OFFLINE_MAX_NUM_SEQS
    out = llm.generate(
        ["The capital of France is"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 8


def test_oversized_request_is_refused_when_added_and_others_run(llm):
    engine = llm.llm_engine
    with pytest.raises(RequestRejectedError, match="KV cache capacity of 640 tokens"):
        engine.add_request("big", {"prompt_token_ids": [100] * 600}, SamplingParams(max_tokens=100))
    ctx = engine.max_model_len
    with pytest.raises(RequestRejectedError, match=f"context of {ctx} tokens"):
        engine.add_request("ctx", {"prompt_token_ids": [100] * 10}, SamplingParams(max_tokens=ctx))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("empty", "")
    assert not engine.has_unfinished_requests()
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert all_blocks_free(llm)


def test_max_tokens_none_runs_to_the_end_of_the_cache(llm):
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [100] * 620}], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 20  # 640 tokens of KV cache in all
    assert out.outputs[0].finish_reason == "length"


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    engine.add_request("a", "Write a long poem about the sea.", params)
    engine.add_request("b", "Count to one hundred:", params)
    for _ in range(3):
        engine.step()
    assert not all_blocks_free(llm)
    outs = engine.abort(["a", "b"])
    assert [o.outputs[0].finish_reason for o in outs] == ["abort", "abort"]
    assert not engine.has_unfinished_requests() and all_blocks_free(llm)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=12, temperature=1.0)
    batch = llm.generate(
        ["A recipe for bread:", "Once upon a time", "def main():"],
        [others, params, others],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone
    unseeded = [
        llm.generate(["Once upon a time"], others, use_tqdm=False)[0].outputs[0].token_ids
        for _ in range(2)
    ]
    assert alone != unseeded[0] or alone != unseeded[1]


def test_stop_string_and_stop_token_finish_reasons(llm):
    tok = llm.get_tokenizer()
    greedy = SamplingParams(max_tokens=12, temperature=0)
    base = llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].outputs[0]
    assert base.text.startswith(" Paris.")
    out = llm.generate(
        ["The capital of France is"],
        SamplingParams(max_tokens=12, temperature=0, stop=["ris."]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == " Pa" and out.finish_reason == "stop" and out.stop_reason == "ris."
    stop_id = base.token_ids[1]
    out = llm.generate(
        ["The capital of France is"],
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == base.token_ids[:2] and out.finish_reason == "stop"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], tokenize=False, add_generation_prompt=True
    )
    out = llm.generate([chat], SamplingParams(max_tokens=64, temperature=0), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == tok.eos_token_id
    assert "<|im_end|>" not in out.text


def test_n_and_logprobs(llm):
    params = SamplingParams(max_tokens=5, temperature=0.8, n=3, seed=7, logprobs=2)
    out = llm.generate(["The weather today is"], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        assert len(c.token_ids) == 5 and len(c.logprobs) == 5
        for tok_id, step in zip(c.token_ids, c.logprobs):
            assert tok_id in step and len(step) <= 3
            assert all(v <= 0 for v in step.values())
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all_blocks_free(llm)


def test_invalid_sampling_params_name_the_field():
    for kwargs, field in [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(n=0), "n"),
        (dict(stop=[""]), "stop"),
    ]:
        with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
            SamplingParams(**kwargs)


def test_model_errors_name_the_path_or_architecture(tmp_path):
    import torch

    with pytest.raises(ModelLoadError, match="does not exist: /no/such/model"):
        load_model("/no/such/model", torch.float32, torch.device("cpu"), "sdpa")
    (tmp_path / "config.json").write_text('{"model_type": "bert", "architectures": ["BertModel"]}')
    with pytest.raises(ModelLoadError, match="unsupported architecture.*BertModel"):
        load_model(tmp_path, torch.float32, torch.device("cpu"), "sdpa")


async def test_async_stream_and_cancel_frees_blocks_within_one_step():
    engine = AsyncLLMEngine.from_config(__import__("engine").EngineConfig(num_kv_blocks=64))
    try:
        prompt = "The capital of France is"
        deltas, ids = [], []
        params = SamplingParams(max_tokens=10, temperature=0, output_kind=RequestOutputKind.DELTA)
        async for out in engine.generate(prompt, params):
            assert len(out.outputs[0].token_ids) <= 1  # only what this step added
            deltas.append(out.outputs[0].text)
            ids += out.outputs[0].token_ids
        assert out.finished and len(ids) == 10
        whole = [
            o async for o in engine.generate(prompt, SamplingParams(max_tokens=10, temperature=0))
        ][-1]
        assert "".join(deltas) == whole.outputs[0].text and ids == whole.outputs[0].token_ids
        assert whole.outputs[0].text.startswith(" Paris")

        steps = []
        real_step = engine.engine.step
        engine.engine.step = lambda: steps.append(1) or real_step()
        stream = engine.generate("Tell me a story.", SamplingParams(max_tokens=500))
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await stream.aclose()
        bm = engine.engine.block_manager
        seen = len(steps)
        for _ in range(100):
            if bm.num_free_blocks == bm.num_blocks:
                break
            await asyncio.sleep(0.01)
        assert bm.num_free_blocks == bm.num_blocks
        assert len(steps) - seen <= 1
        assert not engine.engine.has_unfinished_requests()
    finally:
        await engine.shutdown()


async def test_async_steps_while_the_event_loop_is_busy():
    # The batching loop runs on its own thread: a stream's slow consumer (the event loop
    # busy encoding and sending chunks) does not hold the next step back.
    import time

    engine = AsyncLLMEngine.from_config(EngineConfig(num_kv_blocks=64))
    try:
        steps = []
        real_step = engine.engine.step
        engine.engine.step = lambda: steps.append(time.perf_counter()) or real_step()
        outs = []
        params = SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        async for out in engine.generate("The capital of France is", params):
            outs.append(out)
            if len(outs) == 1:
                t0 = time.perf_counter()
                time.sleep(0.5)  # blocks the event loop
                t1 = time.perf_counter()
        assert sum(len(o.outputs[0].token_ids) for o in outs) == 12 and outs[-1].finished
        assert sum(t0 <= t < t1 for t in steps) >= 2
        assert not engine.engine.has_unfinished_requests()
    finally:
        await engine.shutdown()


async def test_async_engine_failure_ends_every_stream():
    from engine.async_engine import EngineDeadError

    engine = AsyncLLMEngine.from_config(EngineConfig(num_kv_blocks=64))
    try:
        real_step, calls = engine.engine.step, []

        def failing_step():
            calls.append(1)
            if len(calls) > 2:
                raise RuntimeError("boom")
            return real_step()

        engine.engine.step = failing_step

        async def consume(prompt):
            return [o async for o in engine.generate(prompt, SamplingParams(max_tokens=50))]

        results = await asyncio.wait_for(
            asyncio.gather(
                consume("Hello"), consume("The capital of France is"), return_exceptions=True
            ),
            30,
        )
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert engine.dead
        with pytest.raises(EngineDeadError):
            await consume("Hi")
    finally:
        await engine.shutdown()


async def test_async_rejects_before_streaming():
    engine = AsyncLLMEngine.from_config(__import__("engine").EngineConfig(num_kv_blocks=4))
    try:
        with pytest.raises(RequestRejectedError):
            async for _ in engine.generate({"prompt_token_ids": [5] * 100}):
                pass
        assert engine.num_unfinished == 0
    finally:
        await engine.shutdown()


def test_without_chunking_a_request_over_the_budget_is_refused():
    llm = LLM(enable_chunked_prefill=False, max_num_batched_tokens=64, num_kv_blocks=16)
    engine = llm.llm_engine
    with pytest.raises(RequestRejectedError, match="chunked prefill disabled"):
        engine.add_request("long", {"prompt_token_ids": [100] * 60}, SamplingParams(max_tokens=8))
    out = llm.generate(
        [{"prompt_token_ids": [100] * 40}], SamplingParams(max_tokens=8), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 8


async def test_async_arrival_time_is_when_generate_was_called():
    engine = AsyncLLMEngine.from_config(EngineConfig(num_kv_blocks=64))
    try:
        called = engine.engine.clock()
        outs = [o async for o in engine.generate("Hi", SamplingParams(max_tokens=2))]
        assert abs(outs[-1].metrics.arrival_time - called) < 0.05
        snap = engine.load_snapshot()
        assert snap.num_kv_blocks_free == 64 and not snap.running_seqs
        # The replica streams its load once per change: once, then not again while idle.
        update = engine.load_update()
        assert update is not None and not update.running_seqs and update.step_left_s == 0
        assert engine.load_update() is None
    finally:
        await engine.shutdown()


async def test_async_engine_is_built_and_stepped_on_one_worker_thread(monkeypatch):
    # A second thread running torch ops makes libgomp throttle its spin-wait (see
    # AsyncLLMEngine.from_config), so loading and stepping must share one thread.
    import threading

    import engine.async_engine as async_engine
    from engine import EngineConfig

    threads = {}

    class Recording(async_engine.LLMEngine):
        def __init__(self, *args, **kwargs):
            threads["init"] = threading.get_ident()
            super().__init__(*args, **kwargs)

        def step(self):
            threads["step"] = threading.get_ident()
            return super().step()

    monkeypatch.setattr(async_engine, "LLMEngine", Recording)
    engine = AsyncLLMEngine.from_config(EngineConfig(num_kv_blocks=64))
    try:
        outs = [o async for o in engine.generate("Hi", SamplingParams(max_tokens=2))]
        assert outs[-1].finished
        assert threads["init"] == threads["step"] != threading.get_ident()
    finally:
        await engine.shutdown()


async def test_shutdown_ends_an_open_stream_and_refuses_new_requests():
    from engine.async_engine import EngineStoppedError

    engine = AsyncLLMEngine.from_config(EngineConfig(num_kv_blocks=64))
    got = []

    async def consume() -> None:
        async for out in engine.generate("Hi", SamplingParams(max_tokens=900, ignore_eos=True)):
            got.append(out)

    task = asyncio.create_task(consume())
    while not got and not task.done():
        await asyncio.sleep(0.01)
    assert got and not task.done()
    await engine.shutdown()
    with pytest.raises(EngineStoppedError, match="shut down"):
        await asyncio.wait_for(task, timeout=5)
    with pytest.raises(EngineStoppedError):
        async for _ in engine.generate("Hi", SamplingParams(max_tokens=2)):
            pass
    await engine.shutdown()  # a second call is harmless
