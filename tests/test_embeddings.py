"""Embeddings (``PoolingParams``, ``POST /v1/embeddings``): each vector is transformers' final
hidden states pooled and L2-normalized the same way (``tests/embedding_reference.py``:
cosine >= 0.99999, every component within 1e-5, fp32), on the embedded SmolLM2 (fp32
weights and the packed GGUF ones) and on a random Qwen3, under chunked prefill, beside
generation in the same steps, from the prefix cache; and the route's fields, encodings,
usage and metrics on an ingress over a fake replica (not ``slow``: no model)."""

from __future__ import annotations

import base64
import gc
import struct
from dataclasses import replace
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from engine import LLM, LoRARequest, ParamError, PoolingParams, RequestOutputKind, SamplingParams
from policies.limits import RequestLimits
from router.contract import Accepted, ModelInfo, SequenceDelta, StepItem
from router.ingress import Ingress, add_routes, make_app
from router.local import LocalReplicas
from tests.embedding_reference import compare, final_hidden, pool

LENGTHS = (1, 5, 33, 135)
"""conftest's prompts embedded on the SmolLM2 engines: the 135-token one takes three chunks
of their 64-token steps."""
STEP = 64


def all_blocks_free(llm: LLM) -> bool:
    bm = llm.llm_engine.block_manager
    bm.check()
    return bm.num_free_blocks == bm.num_blocks


@pytest.fixture(scope="module")
def chosen(prompts) -> list[list[int]]:
    """The prompts of :data:`LENGTHS`, then one of 63 tokens."""
    return [*(p for p in prompts if len(p) in LENGTHS), (prompts[-1] * 2)[:63]]


@pytest.fixture(scope="module")
def reference(model_dir):
    """The embedded model in transformers, fp32 (its GGUF de-quantized once, as the
    engine's ``quantization: none`` loads it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    yield model
    del model
    gc.collect()


@pytest.fixture(scope="module")
def hidden(reference, chosen) -> dict[tuple[int, ...], torch.Tensor]:
    """:func:`reference`'s final hidden states of each chosen prompt, by its ids."""
    return {tuple(p): final_hidden(reference, p) for p in chosen}


@pytest.fixture(scope="module")
def fp32():
    """fp32 weights, ``last`` pooling, 64-token steps, two sizes to cut to."""
    llm = LLM(
        quantization="none",
        max_num_batched_tokens=STEP,
        num_kv_blocks=64,
        embedding_dimensions=[64, 256],
    )
    yield llm
    del llm
    gc.collect()


def embed(llm: LLM, prompts: list[list[int]], params: PoolingParams | None = None, **kw):
    return llm.embed([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, **kw)


def check(label: str, out, want: torch.Tensor) -> None:
    """``out``'s vector against ``want``; prints the measure."""
    cosine, err = compare(out.embedding, want)
    print(f"{label}, {len(out.prompt_token_ids)} tokens: cosine {cosine:.9f}, max error {err:.1e}")


@pytest.mark.slow
def test_last_pooling_in_chunks_and_beside_generation_is_transformers(
    fp32, hidden, chosen, prompts
):
    """Embedding requests join steps that decode two generating requests: the 63-token
    prompt's last token runs among the decodes (its first chunk takes the 62 tokens they
    leave), the 135-token one spans three chunks; each vector matches the reference, the
    generated tokens are those of a run without embeddings, and each embedding request
    holds no KV block once its vector is out."""
    engine = fp32.llm_engine
    gen = [prompts[6], prompts[8]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = fp32.generate([{"prompt_token_ids": p} for p in gen], params, use_tqdm=False)
    embeds = [chosen[4], *chosen[:4]]
    steps = []
    engine.add_step_listener(steps.append)
    try:
        final = replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        for i, p in enumerate(gen):
            engine.add_request(f"g{i}", {"prompt_token_ids": p}, final)
        while engine.scheduler.waiting or not all(
            r.output_token_ids for r in engine.scheduler.running
        ):
            engine.step()
        for i, p in enumerate(embeds):
            engine.add_request(f"e{i}", {"prompt_token_ids": p}, PoolingParams())
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[out.request_id] = out
                if out.embedding is not None:
                    assert engine.block_manager.block_table(out.request_id) == []
    finally:
        engine.step_listeners.remove(steps.append)
    for i, p in enumerate(embeds):
        out = outs[f"e{i}"]
        assert out.finished and out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].token_ids == [] and out.prompt_token_ids == p
        check("fp32 last", out, pool(hidden[tuple(p)]))
    for i, a in enumerate(alone):
        assert outs[f"g{i}"].outputs[0].token_ids == a.outputs[0].token_ids
    mixed = [s for s in steps if s.num_decodes and any(r[0][0] == "e" for r in s.seqs)]
    assert mixed, "no step mixed embedding chunks with decodes"
    assert any(
        rid == "e0" and i < s.num_decodes for s in steps for i, (rid, _, _) in enumerate(s.seqs)
    ), "the 63-token prompt's last token did not run among the decodes"
    assert sum(rid == f"e{len(embeds) - 1}" for s in steps for rid, _, _ in s.seqs) == 3
    assert all_blocks_free(fp32)


@pytest.mark.slow
def test_a_prefix_cache_hit_gives_the_same_vector(fp32, hidden, chosen):
    p = chosen[3]  # 135 tokens, embedded by the test before
    out = embed(fp32, [p])[0]
    assert out.num_cached_tokens == 128  # its full blocks
    check("fp32 last, cached", out, pool(hidden[tuple(p)]))
    assert all_blocks_free(fp32)


@pytest.mark.slow
def test_dimensions_cut_then_normalize(fp32, hidden, chosen):
    out = embed(fp32, chosen[2:3], PoolingParams(dimensions=64))[0]
    assert len(out.embedding) == 64
    check("fp32 last, 64 dimensions", out, pool(hidden[tuple(chosen[2])], dimensions=64))
    assert len(embed(fp32, chosen[:1], PoolingParams(dimensions=576))[0].embedding) == 576
    with pytest.raises(ParamError, match=r"can be cut to \[64, 256\] only") as e:
        embed(fp32, chosen[:1], PoolingParams(dimensions=100))
    assert e.value.param == "dimensions"
    with pytest.raises(ParamError, match="must be >= 1"):
        PoolingParams(dimensions=0)
    assert not fp32.llm_engine.has_unfinished_requests()


@pytest.mark.slow
def test_an_adapter_embeds_as_peft_applies_it(fp32, lora_dirs, reference, hidden, chosen):
    """With a LoRA adapter (peft's, on all seven projections) a prompt embeds as the
    model peft wraps with it does. peft wraps ``reference`` itself, once ``hidden`` holds
    every base-model reference (no other test reads the model after)."""
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(reference, lora_dirs["B"]).get_base_model()
    want = pool(final_hidden(adapted, chosen[2]))
    assert float(want @ pool(hidden[tuple(chosen[2])])) < 0.99  # the adapter counts
    out = embed(fp32, chosen[2:3], lora_request=LoRARequest("B", lora_dirs["B"]))[0]
    check("fp32 last, adapter B", out, want)


@pytest.mark.slow
def test_mean_pooling_in_chunks_takes_no_cache_hit(hidden, chosen):
    llm = LLM(
        quantization="none", max_num_batched_tokens=STEP, num_kv_blocks=64, embedding_pooling="mean"
    )
    try:
        few = chosen[2:4]  # 33 and 135 tokens
        outs = [*embed(llm, few), *embed(llm, few[:1])]
        assert outs[-1].num_cached_tokens == 0  # 32 would be cached for `last` pooling
        for out in outs:
            check("fp32 mean", out, pool(hidden[tuple(out.prompt_token_ids)], "mean"))
        # Aborted mid-prompt: its blocks and its partial sum are dropped.
        engine, runner = llm.llm_engine, llm.llm_engine.runner
        engine.add_request("cut", {"prompt_token_ids": chosen[3]}, PoolingParams())
        engine.step()
        assert "cut" in runner._pool_sums
        engine.abort("cut")
        embed(llm, chosen[:1])
        assert runner._pool_sums == {} and all_blocks_free(llm)
    finally:
        del llm
        gc.collect()


@pytest.mark.slow
def test_packed_gguf_weights_embed_as_transformers_does(hidden, chosen):
    """The default packed weights (Q4_1 and Q8_0 blocks, de-quantized inside the kernels)
    compute what transformers computes on the same weights de-quantized once, which the
    reference holds: the same bounds apply. The 63-token prompt, alone in 62-token steps,
    ends in a step whose one token is a decode: the model's forward runs it, not the
    packed decode stack (which runs the decode-only steps of generation)."""
    llm = LLM(max_num_batched_tokens=STEP - 2, num_kv_blocks=64)
    try:
        engine, runner = llm.llm_engine, llm.llm_engine.runner
        assert runner.decode_stack is not None and "gguf" in engine.weights.format
        stack, stacked = runner.decode_stack, []
        runner.decode_stack = lambda *args: stacked.append(args) or stack(*args)
        steps = []
        engine.add_step_listener(steps.append)
        outs = [*embed(llm, chosen[4:]), *embed(llm, chosen[1:3])]
        assert steps[1].num_decodes == len(steps[1].seqs) == 1 and not stacked
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": chosen[1]}], params, use_tqdm=False)
        assert stacked  # a decode-only step of generation takes it
        for out in outs:
            check("packed last", out, pool(hidden[tuple(out.prompt_token_ids)]))
        with pytest.raises(ParamError, match="cannot be cut"):
            embed(llm, chosen[:1], PoolingParams(dimensions=64))
        assert all_blocks_free(llm)
    finally:
        del llm
        gc.collect()


@pytest.mark.slow
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_random_qwen3_embeds_as_transformers_does(pooling, tmp_path, tokenizer, chosen):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # norms start at ones: vary them, so the last norm counts
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), max_num_batched_tokens=32, embedding_pooling=pooling)
    assert llm.llm_engine.embedding_size == 64
    for p, out in zip(chosen, embed(llm, chosen)):
        check(f"qwen3 {pooling}", out, pool(final_hidden(model, p), pooling))


# -- the route, on an ingress over a fake replica ---------------------------------------------


class _Tokenizer:
    """One token per character."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


def _vector(ids: list[int], dimensions: int | None) -> list[float]:
    """The fake replica's vector of a prompt: 8 numbers from its ids, cut, normalized, as
    fp32 values (what an engine returns)."""
    raw = [float(ids[i % len(ids)] + i) for i in range(8)][: dimensions or 8]
    norm = sum(x * x for x in raw) ** 0.5
    return list(
        struct.unpack(f"<{len(raw)}f", struct.pack(f"<{len(raw)}f", *(x / norm for x in raw)))
    )


class _Replica:
    """A replica in process (router.local.LocalReplica) that embeds: 8-long vectors, ``mean``
    pooling, cut to 4 as well; it keeps the parameters of each request."""

    replica_id = "fake"
    engine = SimpleNamespace(dead=False)

    def __init__(self) -> None:
        self.params: list[PoolingParams] = []

    def info(self) -> ModelInfo:
        limits = RequestLimits(64, 1024, 64)
        return ModelInfo(
            _Tokenizer(),
            limits,
            embedding_size=8,
            embedding_pooling="mean",
            embedding_dimensions=(4,),
        )

    async def items(self, request_id, prompt_token_ids, params, shape, send_load=True):
        self.params.append(params)
        yield Accepted(len(prompt_token_ids), self.replica_id)
        stop = SequenceDelta(0, "", [], None, "stop", None)
        vector = _vector(prompt_token_ids, params.dimensions)
        yield StepItem([stop], True, queue_s=0.0, cached_tokens=0, embedding=vector)

    def record_routing_stats(self) -> dict:
        return {}


async def test_the_route_answers_validates_and_counts_by_class():
    """Texts and token ids, in order, as floats or base64 (the same numbers; the openai
    client's default decodes to them), usage, ``dimensions`` served or refused, the other
    refusals, ``/v1/models``, ``/metrics`` by class, and a batch line's answer."""
    replica = _Replica()
    keys = {
        "k-i": {"tenant": "a", "traffic_class": "interactive"},
        "k-b": {"tenant": "b", "traffic_class": "batch"},
    }
    settings = {"model_name": "m", "admission": False, "max_embedding_inputs": 3, "api_keys": keys}
    ingress = Ingress(LocalReplicas(replica), settings)
    app = make_app()
    add_routes(app, ingress)
    transport = httpx.ASGITransport(app=app)
    auth = {"Authorization": "Bearer k-i"}
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=auth) as client:

        async def post(body: dict) -> httpx.Response:
            return await client.post("/v1/embeddings", json={"model": "m", **body})

        r = await post({"input": ["ab", "xyz"], "user": "u", "encoding_format": None})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"] == r.headers["x-request-id"] and body["id"].startswith("embd-")
        assert r.headers["x-iterserve-class"] == "interactive"
        assert (body["object"], body["model"]) == ("list", "m")
        assert body["data"] == [
            {"object": "embedding", "index": 0, "embedding": _vector([97, 98], None)},
            {"object": "embedding", "index": 1, "embedding": _vector([120, 121, 122], None)},
        ]
        assert body["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
        assert replica.params[-2:] == [PoolingParams(), PoolingParams()]
        r = await post({"input": "ab", "encoding_format": "base64"})
        raw = base64.b64decode(r.json()["data"][0]["embedding"])
        assert list(struct.unpack("<8f", raw)) == _vector([97, 98], None)
        oa = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k-i", http_client=client)
        res = await oa.embeddings.create(model="m", input=[[97, 98], [120, 121, 122]])
        assert [d.embedding for d in res.data] == [
            _vector([97, 98], None),
            _vector([120, 121, 122], None),
        ]
        assert res.usage.prompt_tokens == 5
        for d in (4, 8):
            r = await post({"input": "ab", "dimensions": d})
            assert r.json()["data"][0]["embedding"] == _vector([97, 98], d)
            assert replica.params[-1] == PoolingParams(dimensions=d)
        served = len(replica.params)
        refused = {
            "dimensions": ({"input": "ab", "dimensions": 3}, 400),
            "encoding_format": ({"input": "ab", "encoding_format": "int8"}, 400),
            "input": ({"input": ["a", "b", "c", "d"]}, 400),
            "stream": ({"input": "ab", "stream": True}, 400),
            "model": ({"input": "ab", "model": "x"}, 404),
        }
        for param, (bad, status) in refused.items():
            r = await post(bad)
            assert (r.status_code, r.json()["error"]["param"]) == (status, param), r.text
        for bad in (
            {"input": ""},
            {"input": []},
            {"input": [[1], []]},
            {"input": [-1]},
            {"input": ["a", [1]]},
        ):
            r = await post(bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
        assert (
            "cut to 4 only"
            in (await post({"input": "a", "dimensions": 5})).json()["error"]["message"]
        )
        assert len(replica.params) == served  # none of them reached the replica
        doc = (await client.get("/openapi.json")).json()
        body_ref = doc["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]
        assert body_ref["application/json"]["schema"]["$ref"].endswith("/EmbeddingRequest")
        declared = doc["components"]["schemas"]["EmbeddingRequest"]["properties"]
        assert {"input", "encoding_format", "dimensions"} <= set(declared)
        card = (await client.get("/v1/models")).json()["data"][0]
        assert (card["embedding_pooling"], card["embedding_dimensions"]) == ("mean", [4, 8])
        answer = await ingress.answer(
            "/v1/embeddings", {"model": "m", "input": ["ab"]}, {"authorization": "Bearer k-b"}
        )
        assert answer.status == 200 and answer.body["data"][0]["embedding"] == _vector(
            [97, 98], None
        )
        streamed = await ingress.answer(
            "/v1/embeddings",
            {"model": "m", "input": "ab", "stream": True},
            {"authorization": "Bearer k-b"},
        )
        refused_stream = await post({"input": "ab", "stream": True})
        assert (streamed.status, streamed.body) == (400, refused_stream.json())
        bad = await ingress.answer(
            "/v1/embeddings",
            {"model": "m", "input": "ab", "dimensions": 3},
            {"authorization": "Bearer k-b"},
        )
        assert bad.status == 400 and bad.body["error"]["param"] == "dimensions"
        scrape = (await client.get("/metrics")).text
    counts = {
        (name, cls): float(line.rsplit(" ", 1)[1])
        for line in scrape.splitlines()
        for name in ("embedding_requests_total", "embedding_prompt_tokens_total")
        for cls in ("interactive", "batch")
        if line.startswith(f'iterserve:{name}{{model="m",traffic_class="{cls}"}}')
    }
    # interactive: 2 + 1 + 2 + 2 inputs (the refused ones not counted); batch: 1
    assert counts == {
        ("embedding_requests_total", "interactive"): 7,
        ("embedding_prompt_tokens_total", "interactive"): 5 + 2 + 5 + 2 + 2,
        ("embedding_requests_total", "batch"): 1,
        ("embedding_prompt_tokens_total", "batch"): 2,
    }
