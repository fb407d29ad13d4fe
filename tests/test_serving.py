"""The real application (Ray Serve, 2 replicas of the default model) through the openai client.

One module-scoped server. Replica faults (a replica killed or stopped mid-stream, the
server stopped by a signal) are tested on a server of their own, with short health
checks: ``tests/faults/test_replica_faults.py``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")

from router.tenants import ApiKeyConfig  # noqa: E402
from tests import serving_app as app  # noqa: E402
from tests.serving_app import (  # noqa: E402
    INTERACTIVE_TTFT_SLO_S,
    MAX_NUM_SEQS,
    MODEL,
    PROMPT,
    post,
    service_config,
)
from tests.serving_errors import (  # noqa: E402, F401  (collected against this module's server)
    test_bad_chat_input,
    test_bad_input_gets_openai_error,
    test_client_disconnect_aborts_and_frees_blocks,
    test_inputs_that_once_stopped_the_engine,
    test_malformed_json_oversized_body_and_auth,
)

pytestmark = pytest.mark.slow

ADMIN_KEY = "sk-admin"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The Ray cluster of running_app has 2 CPUs, whatever the host has.
    config = service_config(
        tmp_path_factory, num_replicas=2, replica_num_cpus=1, allow_runtime_lora_updates=True
    )
    admin = {ADMIN_KEY: ApiKeyConfig(tenant="ops", admin=True)}
    config = config.model_copy(update={"api_keys": {**config.api_keys, **admin}})
    with app.running_app(config, replicas=2) as url:
        yield url


# -- correctness ----------------------------------------------------------------------------


def test_completion_matches_transformers_generate(server, model_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    out = app.client(server).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :]
    assert out.choices[0].text == tokenizer.decode(ref, skip_special_tokens=True)
    assert out.usage.prompt_tokens == ids.shape[1]
    assert out.usage.completion_tokens == len(ref)
    assert out.choices[0].finish_reason == "length"


def test_echo_scores_a_prompt_as_transformers_does(server, model_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    out = app.client(server).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = out.choices[0]
    ids = tokenizer(PROMPT).input_ids
    assert choice.text == PROMPT and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    want = [float(ref[p - 1, ids[p]]) for p in range(1, len(ids))]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=2e-3)
    # Echo with a completion: the prompt, then the same greedy text as without echo.
    plain = app.client(server).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0
    )
    echoed = app.client(server).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    streamed = "".join(
        c.choices[0].text
        for c in app.client(server).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True
        )
    )
    assert streamed == echoed.choices[0].text


def test_embeddings_through_the_openai_client(server, model_dir, tokenizer):
    """``client.embeddings.create``: texts (base64, the client's default) and token ids
    (floats) give transformers' last-token final hidden states, L2-normalized; ``dimensions``
    is served for the configured size only; ``usage`` and ``/metrics`` count the inputs by
    class; ``/v1/models`` states the pooling."""
    import torch
    from transformers import AutoModelForCausalLM

    from deploy.top import scrape
    from tests.embedding_reference import compare, final_hidden, pool

    texts = [PROMPT, "Once upon a time"]
    ids = [tokenizer.encode(t) for t in texts]
    names = ("iterserve:embedding_requests_total", "iterserve:embedding_prompt_tokens_total")
    labels = (("model", MODEL), ("traffic_class", "interactive"))
    before = scrape(server)
    client = app.client(server, key="sk-interactive")
    coded = client.embeddings.create(model=MODEL, input=texts)
    floats = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    cut = client.embeddings.create(model=MODEL, input=ids[0], dimensions=64)
    assert coded.usage.prompt_tokens == floats.usage.prompt_tokens == sum(map(len, ids))
    assert [d.index for d in coded.data] == [0, 1]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hidden = [final_hidden(model, p) for p in ids]
    for a, b, h in zip(coded.data, floats.data, hidden):
        compare(a.embedding, pool(h))
        compare(b.embedding, pool(h))
    compare(cut.data[0].embedding, pool(hidden[0], dimensions=64))
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input=texts[0], dimensions=100)
    assert e.value.body["param"] == "dimensions"
    after = scrape(server)
    added = [after[(n, labels)] - before.get((n, labels), 0.0) for n in names]
    assert added == [5, 2 * sum(map(len, ids)) + len(ids[0])]
    card = httpx.get(
        f"{server}/v1/models", headers={"Authorization": "Bearer sk-interactive"}
    ).json()["data"][0]
    assert (card["embedding_pooling"], card["embedding_dimensions"]) == ("last", [64, 576])


def test_several_prompts_index_choices_across_prompts_and_n(server):
    prompts = [PROMPT, "Once upon a time"]
    out = app.client(server).completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=0
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    alone = [
        app.client(server)
        .completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    assert [c.text for c in out.choices] == [alone[0], alone[0], alone[1], alone[1]]
    finishes: dict[int, int] = {}
    for chunk in app.client(server).completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=0.8, stream=True
    ):
        for c in chunk.choices:
            finishes[c.index] = finishes.get(c.index, 0) + (c.finish_reason is not None)
    assert finishes == {0: 1, 1: 1, 2: 1, 3: 1}


def test_models_and_health(server):
    models = app.client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    h = app.health(server)
    assert h["status"] == "ok" and h["num_replicas"] == 2


def test_chat_streaming_equals_non_streaming_with_one_usage_chunk(server, tokenizer):
    client = app.client(server)
    messages = [{"role": "user", "content": "Name three colours."}]
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = [c for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0] is chunks[-1] and usage[0].choices == []
    # The same prompt again: its whole blocks now come from the replica's prefix cache.
    # (The first may find the chat template's system prompt cached by an earlier test.)
    streamed, plain = usage[0].usage.model_dump(), full.usage.model_dump()
    cached = streamed.pop("prompt_tokens_details")["cached_tokens"]
    assert plain.pop("prompt_tokens_details")["cached_tokens"] < cached
    assert streamed == plain and cached == (plain["prompt_tokens"] - 1) // 16 * 16
    choice_chunks = [c for c in chunks if c.choices]
    assert choice_chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in choice_chunks)
    assert text == full.choices[0].message.content and text
    assert [c.choices[0].finish_reason for c in choice_chunks][-1] == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    expected_prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert full.usage.prompt_tokens == len(
        tokenizer.encode(expected_prompt, add_special_tokens=False)
    )


def test_shared_prefix_is_computed_once(server):
    """The second of two prompts that share 500 tokens prefills only its suffix: the
    router sends it to the replica that holds the prefix, whose cache supplies 31 whole
    16-token blocks (OpenAI's ``usage.prompt_tokens_details.cached_tokens``)."""
    prefix = [100 + (i * 7919) % 40_000 for i in range(500)]
    client = app.client(server)
    outs = [
        client.completions.create(model=MODEL, prompt=prefix + tail, max_tokens=4, temperature=0)
        for tail in ([11, 12, 13], [21, 22, 23])
    ]
    cached = [o.usage.prompt_tokens_details.cached_tokens for o in outs]
    assert cached == [0, 496] and [o.usage.prompt_tokens for o in outs] == [503, 503]
    streamed = list(
        client.completions.create(
            model=MODEL,
            prompt=prefix + [31, 32],
            max_tokens=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == 496


def test_completion_streaming_equals_non_streaming(server):
    client = app.client(server)
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0.8, seed=7)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_stop_string_stream_and_not(server):
    client = app.client(server)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stop=["."])
    full = client.completions.create(**kw)
    assert full.choices[0].text == " Paris"  # greedy: " Paris.\n\n..."
    assert full.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert streamed == " Paris"


def test_n_seed_and_logprobs(server):
    client = app.client(server)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=11, logprobs=2)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert a.usage.completion_tokens == 3 * 8
    lp = a.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 8
    assert "".join(lp.tokens) == a.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(2 <= len(t) <= 3 for t in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 for c in content)
    # Greedy: the sampled token is the most likely one.
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


def test_max_tokens_null_means_unset(server):
    r = post(
        server,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": None,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["finish_reason"] == "stop"  # ran to EOS
    assert out["usage"]["completion_tokens"] > 0


# -- bad input ------------------------------------------------------------------------------


def test_chat_response_format_json_schema(server):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population_millions": {"type": "number"},
        },
        "required": ["city", "population_millions"],
        "additionalProperties": False,
    }
    chat = app.client(server).chat.completions.create(
        model=MODEL,
        max_tokens=64,
        temperature=0,
        messages=[{"role": "user", "content": "Name a large city and its population."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": schema, "strict": True},
        },
    )
    assert chat.choices[0].finish_reason == "stop"
    data = json.loads(chat.choices[0].message.content)
    assert set(data) == {"city", "population_millions"} and isinstance(data["city"], str)
    r = post(
        server,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "nope"}},
            },
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    # A named tool call on Ray Serve: the grammar travels with the request to the replica.
    tool = {"type": "function", "function": {"name": "describe_city", "parameters": schema}}
    called = app.client(server).chat.completions.create(
        model=MODEL,
        max_tokens=64,
        temperature=0,
        messages=[{"role": "user", "content": "Name a large city and its population."}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "describe_city"}},
    )
    assert called.choices[0].finish_reason == "tool_calls"
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "describe_city"
    assert set(json.loads(call.function.arguments)) == {"city", "population_millions"}


def test_cors_preflight_from_a_browser_origin(server):
    r = httpx.options(
        f"{server}/v1/chat/completions",
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
        timeout=10,
    )
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] in ("*", "https://app.example")
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = post(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "max_tokens": 1},
        Origin="https://app.example",
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"]


# -- load -----------------------------------------------------------------------------------


def test_50_concurrent_streams(server):
    """50 streams at once all complete and leave nothing behind. They are batch class,
    which admission holds but never refuses: a loaded 2-core host may not meet the
    standard class's SLOs with every seat decoding, and then a 429 would be right."""

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"Request {i}: the weather today is",
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
            stream=True,
        )
        text, reason = "", None
        async for c in stream:
            text += c.choices[0].text
            reason = c.choices[0].finish_reason or reason
        return text, reason

    async def main():
        client = openai.AsyncOpenAI(
            base_url=f"{server}/v1", api_key="sk-batch", max_retries=0, timeout=120
        )
        return await asyncio.gather(*(one(client, i) for i in range(50)))

    results = asyncio.run(main())
    assert len(results) == 50
    assert all(reason == "length" and text for text, reason in results)
    app.wait_idle(server)


def test_interactive_first_token_while_batch_saturates(server):
    num_batch = 2 * MAX_NUM_SEQS + 8  # every seat of both replicas, and a queue
    done = []
    lock = threading.Lock()

    def run_batch(i: int) -> None:
        client = app.client(server, "sk-batch")
        out = client.completions.create(
            model=MODEL,
            prompt=f"Batch job {i}:",
            max_tokens=48,
            extra_body={"ignore_eos": True},
            temperature=0,
        )
        with lock:
            done.append((time.monotonic(), out.choices[0].finish_reason))

    threads = [threading.Thread(target=run_batch, args=(i,)) for i in range(num_batch)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60
        # Every batch request at a replica or held by admission (no seat for it), and one
        # replica's seats full.
        while True:
            h = app.health(server)
            replicas = h.get("replicas", [])
            if (
                sum(r["running"] + r["waiting"] for r in replicas)
                + h.get("held", {}).get("batch", 0)
                == num_batch
                and max(r["running"] for r in replicas) == MAX_NUM_SEQS
            ):
                break
            assert time.monotonic() < deadline, h
            time.sleep(0.2)

        # A class that cannot meet its SLO behind this load is refused with a Retry-After.
        r = post(
            server,
            "/v1/completions",
            {"model": MODEL, "prompt": "a", "max_tokens": 4},
            key="sk-batch",
            **{"x-iterserve-class": "tight"},
        )
        assert r.status_code == 429, r.text
        assert (
            int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["type"] == "rate_limit_error"
        )

        sent = time.monotonic()
        stream = app.client(server, "sk-interactive").completions.create(
            model=MODEL,
            prompt="Quick question: what is 2+2?",
            max_tokens=4,
            temperature=0,
            stream=True,
        )
        first = next(iter(stream))
        ttft = time.monotonic() - sent
        with lock:
            finished_before = len(done)
        list(stream)
    finally:  # a failure above must not leave this load running into the next test
        for t in threads:
            t.join(timeout=300)
    assert first.choices[0].text is not None
    # A batch request needs some 50 steps, the interactive one a few: had it waited for a
    # seat (no preemption) a batch request would have finished first, however fast the host.
    assert finished_before == 0, f"{finished_before} batch requests ended before the first token"
    assert ttft < INTERACTIVE_TTFT_SLO_S, f"interactive TTFT {ttft:.2f} s behind batch load"
    assert len(done) == num_batch and all(reason == "length" for _, reason in done)
    app.wait_idle(server)


def test_an_adapter_loaded_at_run_time_serves_on_every_replica(
    server, model_dir, tokenizer, lora_dirs
):
    # Loaded through one replica, which checks it; each replica reads it from its path
    # on its first request there, so every answer is the merged model's.
    from tests.test_generation import greedy_reference

    ids = tokenizer.encode(PROMPT)
    [(ref, _)] = greedy_reference(model_dir, [ids], 8, adapter=lora_dirs["A"])
    body = {"lora_name": "qv", "lora_path": lora_dirs["A"]}
    r = post(server, "/v1/load_lora_adapter", body, key=ADMIN_KEY)
    assert r.status_code == 200, r.text
    try:
        assert "qv" in [m.id for m in app.client(server).models.list().data]
        req = {"model": "qv", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                headers = {"Authorization": "Bearer sk-standard"}
                calls = [
                    client.post(f"{server}/v1/completions", json=req, headers=headers)
                    for _ in range(12)
                ]
                return await asyncio.gather(*calls)

        answers = asyncio.run(burst())
        assert [a.status_code for a in answers] == [200] * 12, answers[0].text
        assert {a.json()["choices"][0]["text"] for a in answers} == {tokenizer.decode(ref)}
        print("replicas serving the adapter:", {a.headers["x-iterserve-replica"] for a in answers})
    finally:
        r = post(server, "/v1/unload_lora_adapter", {"lora_name": "qv"}, key=ADMIN_KEY)
        assert r.status_code == 200, r.text
    r = post(server, "/v1/completions", req)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
