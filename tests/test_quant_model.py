"""The embedded GGUF served packed (``quantization: auto``) against the same file de-quantized
to fp32 (``quantization: none``): the same weights, the same greedy tokens under hostile
schedules, the same prompt log-probabilities, the memory of the file; and ``int8``/``int4``
on a transformers directory within their bounds of the unquantized model."""

from __future__ import annotations

import gc
import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.loader import default_gguf_path, weight_bytes
from engine.quant import kernels as quant_kernels
from engine.quant.decode_stack import DecodeStack
from engine.quant.formats import PackedTensor
from engine.quant.linear import QuantLinear

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(quant_kernels.load() is None, reason="no C compiler"),
]

MAX_TOKENS = 12
NEAR_TIE = 1e-4
"""A divergence is accepted only where the fp32 path's top-2 log-probabilities are closer."""
KV_BLOCKS = 400


def run(llm: LLM, prompts, **params):
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, **params)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def free(llm: LLM) -> None:
    engine = llm.llm_engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check()
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def fp32(prompts):
    """The fp32 path's greedy outputs (with top-2 log-probabilities) and prompt
    log-probabilities, with the engine's offline defaults."""
    llm = LLM(quantization="none", num_kv_blocks=KV_BLOCKS)
    assert llm.llm_engine.runner.weights.format == "float32"
    greedy = run(llm, prompts, logprobs=2)
    plp = run(llm, prompts[-6:], prompt_logprobs=1)
    free(llm)
    return greedy, plp


def assert_same_greedy(outputs, reference):
    """Equal token for token, a divergence accepted only at a near tie of the reference."""
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        got, want = out.outputs[0].token_ids, ref.outputs[0].token_ids
        for pos, (a, b) in enumerate(zip(got, want)):
            if a != b:
                top2 = sorted(ref.outputs[0].logprobs[pos].values(), reverse=True)[:2]
                gap = top2[0] - top2[1]
                assert gap < NEAR_TIE, f"prompt {i} diverges at token {pos} (top-2 gap {gap:.3g})"
                break
        else:
            assert got == want, f"prompt {i}: {got} != {want}"


HOSTILE = {
    # Chunks of at most 7 tokens in steps of 23, three requests at a time.
    "budget-23-threshold-7-seqs-3": dict(
        max_num_batched_tokens=23, long_prefill_token_threshold=7, max_num_seqs=3
    ),
    # 60 blocks of 16 tokens: the 712-token request fits alone, the batch does not.
    "budget-97-preemption": dict(max_num_batched_tokens=97, num_kv_blocks=60),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_packed_greedy_equals_the_fp32_path(name, prompts, fp32):
    config = {"num_kv_blocks": KV_BLOCKS, **HOSTILE[name]}
    llm = LLM(**config)
    engine = llm.llm_engine
    assert engine.runner.weights.format == "gguf Q4_1+Q8_0"
    assert engine.runner.decode_stack is not None
    assert_same_greedy(run(llm, prompts), fp32[0])
    if "preemption" in name:
        assert engine.scheduler.num_preemptions > 0
    # Again, now that the prompts' blocks are in the prefix cache.
    hits = engine.block_manager.num_hit_tokens
    assert_same_greedy(run(llm, prompts), fp32[0])
    assert engine.block_manager.num_hit_tokens > hits
    free(llm)


def test_packed_prompt_logprobs_are_within_1e4_of_the_fp32_path(prompts, fp32):
    llm = LLM(num_kv_blocks=KV_BLOCKS, max_num_batched_tokens=97)
    outs = run(llm, prompts[-6:], prompt_logprobs=1)
    worst = 0.0
    for out, ref in zip(outs, fp32[1]):
        for got, want in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            for tok, lp in want.items():
                if tok in got:
                    worst = max(worst, abs(got[tok] - lp))
    assert worst < 1e-4, worst
    free(llm)


def test_structured_output_is_the_same_packed_and_fp32():
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
        "required": ["city", "year"],
    }
    texts = []
    for q in ("auto", "none"):
        llm = LLM(quantization=q, num_kv_blocks=64)
        sp = SamplingParams(max_tokens=40, temperature=0, json_schema=schema)
        texts.append(llm.generate(["A famous city and its founding year:"], sp)[0].outputs[0])
        free(llm)
    assert texts[0].token_ids == texts[1].token_ids


def test_the_decode_stack_gives_the_models_own_logits_bit_for_bit(prompts):
    llm = LLM(num_kv_blocks=KV_BLOCKS)
    runner = llm.llm_engine.runner
    stack = runner.decode_stack
    assert isinstance(stack, DecodeStack)
    with_stack = run(llm, prompts[:8], logprobs=3)
    runner.decode_stack = None
    without = run(llm, prompts[:8], logprobs=3)
    runner.decode_stack = stack
    for a, b in zip(with_stack, without):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    free(llm)


def test_resident_weights_are_the_files_tensor_bytes():
    import gguf

    reader = gguf.GGUFReader(default_gguf_path())
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    del reader
    llm = LLM(num_kv_blocks=16)
    model = llm.llm_engine.runner.model
    held = weight_bytes(model)
    assert held == llm.llm_engine.runner.weights.bytes
    assert abs(held - file_bytes) <= 0.1 * file_bytes, (held, file_bytes)
    # No fp32 copy of a packed weight: every linear layer is packed, the LM head shares the
    # embedding's bytes.
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    head = model.lm_head
    assert isinstance(head, QuantLinear) and isinstance(head.parts[0], PackedTensor)
    assert head.parts[0].data.data_ptr() == model.model.embed_tokens.table.data.data_ptr()
    free(llm)


# -- int8 / int4 on a transformers directory ---------------------------------------------

TEACHER_PROMPTS, TEACHER_TOKENS = 24, 64
BOUNDS = {"int8": (0.99, 0.02), "int4": (0.95, 0.05)}
"""quantization: (least top-1 agreement where the unquantized model is decisive, largest
relative change of perplexity)."""
DECISIVE = 0.2
"""Positions whose unquantized top-2 log-probabilities are at least this far apart (nats).
At closer ones a top-1 flip says little: on this model and text, int8 with group-32 scales
(Q8_0's) flips 3% of all positions while its perplexity moves by 0.5%."""


@pytest.fixture(scope="module")
def held_text(tokenizer):
    """24 windows of 65 tokens of the corpus (teacher forcing: 64 predicted tokens each)."""
    from tests.conftest import CORPUS

    ids = tokenizer.encode(CORPUS)
    n = TEACHER_TOKENS + 1
    return [ids[(i * 41) % (len(ids) - n) :][:n] for i in range(TEACHER_PROMPTS)]


def teacher_forced(llm: LLM, windows):
    """Per predicted token: (top-1 token, log-probability of the true token, top-2 gap)."""
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], sp, use_tqdm=False)
    rows = []
    for out, w in zip(outs, windows):
        for entry, true in zip(out.prompt_logprobs[1:], w[1:]):
            # The true token's entry first, then the top two (where not the true token).
            top = sorted(entry.items(), key=lambda kv: -kv[1])
            rows.append((top[0][0], entry[true], top[0][1] - top[1][1]))
    return rows


@pytest.fixture(scope="module")
def unquantized(model_dir, held_text):
    llm = LLM(str(model_dir), num_kv_blocks=KV_BLOCKS)
    out = teacher_forced(llm, held_text)
    free(llm)
    return out


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_weight_only_quantization_stays_within_its_bounds(
    quantization, model_dir, held_text, unquantized
):
    """On the embedded model's fp32 directory. Its weights lie on the GGUF's Q4_1 grid, so
    int4 (Q4_1 with group-32 minimum and scale) must reproduce them; int8's per-channel
    scales do not fit that grid."""
    llm = LLM(str(model_dir), quantization=quantization, num_kv_blocks=KV_BLOCKS)
    assert llm.llm_engine.runner.weights.format.startswith(quantization)
    got = teacher_forced(llm, held_text)
    free(llm)
    pairs = list(zip(got, unquantized))
    decisive = [a[0] == b[0] for a, b in pairs if b[2] >= DECISIVE]
    ppl = [math.exp(-sum(r[1] for r in rows) / len(rows)) for rows in (got, unquantized)]
    least_agreement, most_ppl_change = BOUNDS[quantization]
    overall = sum(a[0] == b[0] for a, b in pairs) / len(pairs)
    print(
        f"{quantization}: top-1 agreement {overall:.4f} overall, "
        f"{sum(decisive) / len(decisive):.4f} at {len(decisive)} decisive positions; "
        f"perplexity {ppl[0]:.3f} vs {ppl[1]:.3f}"
    )
    assert len(decisive) >= len(pairs) // 2
    assert sum(decisive) / len(decisive) >= least_agreement
    assert abs(ppl[0] / ppl[1] - 1) <= most_ppl_change
    if quantization == "int4":
        assert overall == 1.0


def test_quantizing_a_gguf_or_without_kernels_is_refused(model_dir, monkeypatch):
    from engine.model.loader import ModelLoadError

    with pytest.raises(ModelLoadError, match="already quantized"):
        LLM(quantization="int8", num_kv_blocks=16)
    with pytest.raises(ModelLoadError, match="fp32 on the CPU"):
        LLM(str(model_dir), quantization="int4", dtype="bfloat16", num_kv_blocks=16)


def test_a_mix_of_formats_runs_packed_as_its_fp32_path(tmp_path_factory, prompts):
    """Q5_0, Q8_0, Q4_0, Q5_1 and Q4_1 in one file (``tests/gguf_mixed.py``): the q/k/v
    projection joins two formats, and decode steps still run in one C call."""
    from tests.gguf_mixed import write_mixed_gguf

    path = write_mixed_gguf(default_gguf_path(), tmp_path_factory.mktemp("mix") / "mixed.gguf")
    runs = {}
    for q in ("none", "auto"):
        llm = LLM(str(path), quantization=q, num_kv_blocks=KV_BLOCKS, max_num_batched_tokens=97)
        runs[q] = run(llm, prompts[:12], logprobs=2)
        if q == "auto":
            runner = llm.llm_engine.runner
            assert runner.weights.format.startswith("gguf ")
            assert {"Q5_0", "Q8_0", "Q4_0", "Q5_1", "Q4_1"} <= set(
                runner.weights.format[5:].split("+")
            )
            qkv = runner.model.model.layers[0].self_attn.qkv_proj.base  # in its LoRA wrapper
            assert qkv.formats() == ["Q5_0", "Q8_0"]
            assert runner.decode_stack is not None
        free(llm)
    assert_same_greedy(runs["auto"], runs["none"])
