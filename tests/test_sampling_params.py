"""Penalties, logit bias, min-p, top-k, top-p, the random draw and min_tokens: each checked
against a reference, per request inside a mixed batch, and refused with the field's name
when out of range."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, ParamError, RequestOutputKind
from engine import SamplingParams as SP
from engine.core.request import Request
from engine.model import sampler
from engine.model.logits_processors import apply
from engine.model.sampler import Sampler

VOCAB = 10


def _req(prompt, output, **params) -> Request:
    r = Request("r", list(prompt), SP(**params), 0.0, 16)
    for t in output:
        r.append_token(t)
    return r


def test_penalties_and_bias_are_the_documented_logit_transforms():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0, 1.0, 1.5, -0.5, 0.25]])
    req = _req(
        [1, 2],
        [3, 3, 4],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logit_bias={7: -1.0, 9: 3.0},
    )
    got = apply(logits, [req], eos_token_ids=[0])[0]
    want = logits[0].clone()
    want[7] -= 1.0
    want[9] += 3.0
    for t in (1, 2, 3, 4):  # CTRL: prompt and output tokens, positive / p, negative * p
        want[t] = want[t] / 2 if want[t] > 0 else want[t] * 2
    want[3] -= 0.5 * 2 + 0.25  # OpenAI: frequency x count + presence, over the output
    want[4] -= 0.5 * 1 + 0.25
    assert torch.allclose(got, want)
    assert torch.equal(logits[0, 3], torch.tensor(3.0))  # the input is not modified


def test_rows_without_processors_keep_the_models_logits():
    logits = torch.randn(3, VOCAB)
    plain = [_req([1], [2]), _req([3], [])]
    assert apply(logits, plain, eos_token_ids=[0]) is logits
    mixed = apply(logits, [plain[0], _req([1], [2], presence_penalty=1.0), plain[1]], [0])
    assert torch.equal(mixed[0], logits[0]) and torch.equal(mixed[2], logits[2])
    assert not torch.equal(mixed[1], logits[1])


def test_min_tokens_holds_back_eos_and_stop_ids_then_releases_them():
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 10.0  # EOS would win
    early = _req([5], [6], min_tokens=2, stop_token_ids=[8])
    row = apply(logits, [early], eos_token_ids=[0])[0]
    assert row[0] == float("-inf") and row[8] == float("-inf") and row[1] == 0
    done = _req([5], [6, 7], min_tokens=2, stop_token_ids=[8])
    assert apply(logits, [done], eos_token_ids=[0])[0, 0] == 10.0


def test_min_p_keeps_tokens_within_a_fraction_of_the_top_probability():
    # Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.35 keeps tokens 0 and 1 only.
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    sampler = Sampler(torch.device("cpu"), seed=0)
    reqs = [_req([1], [], temperature=1.0, min_p=0.35, seed=s) for s in range(200)]
    drawn = {r.token_id for r in sampler.sample(probs.log().repeat(200, 1), reqs)}
    assert drawn == {0, 1}


def _sorted_reference(logits: torch.Tensor, params: list[SP]) -> torch.Tensor:
    """Temperature, then top-k and top-p by sorting every row whole (a row with neither
    is left as it is)."""
    logits = logits / torch.tensor([p.temperature for p in params]).unsqueeze(1)
    vocab = logits.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    out = sampler._top_k_top_p_sorted(logits, ks, [p.top_p for p in params])
    plain = [i for i, p in enumerate(params) if ks[i] == vocab and p.top_p >= 1]
    out[plain] = logits[plain]
    return out


def test_top_k_and_top_p_keep_what_a_full_sort_keeps():
    # Peaked rows are decided on the top-ranked candidates; the flat last row's top-p set
    # is larger than the candidates, so it takes the full sort.
    vocab = 4 * sampler.TOP_CANDIDATES
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, vocab, generator=gen) * 4
    logits[-1] = torch.rand(vocab, generator=gen) * 0.01
    params = [
        SP(temperature=0.8, top_p=0.9),
        SP(top_k=50),
        SP(top_k=7, top_p=0.5),
        SP(temperature=1.3, top_k=sampler.TOP_CANDIDATES + 500, top_p=0.97),
        SP(temperature=0.7),
        SP(top_p=0.3),
        SP(top_p=0.99),
    ]
    got = sampler._filter(logits, params)
    want = _sorted_reference(logits, params)
    kept = got.isfinite()
    assert torch.equal(kept, want.isfinite())
    assert torch.equal(got[kept], want[kept])
    assert kept[1].sum() == 50 and kept[2].sum() <= 7 and kept[4].all()
    # Near-uniform, so top-p 0.99 keeps about 99% of the vocabulary.
    assert abs(kept[-1].sum() / vocab - 0.99) < 0.005


def test_draws_follow_the_distribution_and_never_pick_a_removed_token():
    # Mass in both of two blocks of the two-level search, and a vocabulary that is not a
    # whole number of blocks.
    vocab = sampler.DRAW_BLOCK + 300
    probs = torch.zeros(vocab)
    tokens, mass = (
        [3, sampler.DRAW_BLOCK - 1, sampler.DRAW_BLOCK, vocab - 2],
        [0.5, 0.3, 0.15, 0.05],
    )
    probs[tokens] = torch.tensor(mass)
    n = 4000
    reqs = [_req([1], [], temperature=1.0, seed=s) for s in range(n)]
    drawn = [
        r.token_id for r in Sampler(torch.device("cpu"), 0).sample(probs.log().repeat(n, 1), reqs)
    ]
    for t, p in zip(tokens, mass):
        share = drawn.count(t) / n
        assert abs(share - p) < 4 * (p * (1 - p) / n) ** 0.5, (t, share, p)
    assert set(drawn) == set(tokens)
    # The ends of the uniform draw land on the first and the last token of positive mass.
    ends = sampler._locate(probs.repeat(2, 1), torch.tensor([1e-12, 1.0], dtype=torch.float64))
    assert ends.tolist() == [3, vocab - 2]


def test_out_of_range_values_name_the_field():
    bad = [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(min_p=1.5), "min_p"),
        (dict(logit_bias={3: 101}), "logit_bias"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
    ]
    for kwargs, name in bad:
        with pytest.raises(ParamError, match=f"SamplingParams.{name}=") as e:
            SP(**kwargs)
        assert e.value.param == name


def test_extreme_temperature_and_top_p_still_draw_the_top_token():
    # A temperature near fp32's smallest normal overflowed the logits to inf (NaN softmax),
    # and a top_p that rounds to 0 in fp32 removed every token: both drew an id outside
    # the vocabulary, which killed the engine at its next step.
    logits = torch.randn(3, 4 * sampler.TOP_CANDIDATES, generator=torch.Generator().manual_seed(1))
    reqs = [
        _req([1], [], temperature=1e-38, seed=1),
        _req([1], [], temperature=2, top_p=1e-50),
        _req([1], [], temperature=2, top_k=5, top_p=1e-300, seed=2),
    ]
    drawn = [r.token_id for r in Sampler(torch.device("cpu"), 0).sample(logits, reqs)]
    assert drawn == logits.argmax(dim=-1).tolist()
    assert SP(temperature=1e-6).greedy and not SP(temperature=1e-4).greedy
    kept = sampler._top_k_top_p_sorted(logits, [logits.shape[1]] * 3, [0.0] * 3).isfinite()
    assert kept.sum(dim=-1).tolist() == [1, 1, 1]


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=64, max_num_seqs=8)


def test_token_ids_outside_the_vocabulary_are_refused_by_name(llm):
    engine = llm.llm_engine
    vocab = engine.runner.vocab_size
    for name, params in (
        ("logit_bias", SP(logit_bias={vocab: 1.0})),
        ("stop_token_ids", SP(stop_token_ids=[-1])),
    ):
        with pytest.raises(ParamError, match="token id -?\\d+ is outside") as e:
            engine.validate({"prompt_token_ids": [1, 2]}, params)
        assert e.value.param == name


def test_repetition_penalty_matches_transformers(llm, model_dir, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = prompts[6]
    with torch.inference_mode():
        ref = model.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, repetition_penalty=1.3
        )[0, len(ids) :].tolist()
    params = SP(max_tokens=12, temperature=0, repetition_penalty=1.3, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref


def test_a_plain_greedy_request_is_the_same_beside_penalized_ones(llm, prompts):
    plain = SP(max_tokens=10, temperature=0, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": prompts[8]}], plain, use_tqdm=False)[0]
    noisy = [
        SP(
            max_tokens=10,
            temperature=0,
            ignore_eos=True,
            frequency_penalty=2.0,
            logit_bias={t: 100.0 for t in range(5)},
        ),
        SP(max_tokens=10, temperature=0.9, seed=3, min_p=0.1, repetition_penalty=1.5),
    ]
    outs = llm.generate(
        [{"prompt_token_ids": prompts[i]} for i in (8, 9, 10)], [plain, *noisy], use_tqdm=False
    )
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert all(t < 5 for t in outs[1].outputs[0].token_ids)  # the bias took hold there


def test_min_tokens_delays_eos(llm):
    eos = next(iter(llm.llm_engine.eos_token_ids))
    forced = {eos: 100.0}  # EOS is the top token at every step
    out = llm.generate(["Hi"], SP(max_tokens=8, temperature=0, logit_bias=forced), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    out = llm.generate(
        ["Hi"], SP(max_tokens=8, temperature=0, logit_bias=forced, min_tokens=3), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == eos and eos not in out.token_ids[:3]


def test_a_delta_output_reports_a_finished_sequence_once():
    from engine.core.outputs import RequestGroup, make_output
    from engine.core.request import FinishReason, RequestStatus

    class _Detok:
        text = ""

    seqs = [_req([1], [], output_kind=RequestOutputKind.DELTA) for _ in range(2)]
    for k, r in enumerate(seqs):
        r.request_id, r.index, r.detokenizer = f"n2-{k}", k, _Detok()
        r.append_token(5)
    seqs[0].status, seqs[0].finish_reason = RequestStatus.FINISHED, FinishReason.STOP
    group = RequestGroup("n2", None, seqs, 0.0, RequestOutputKind.DELTA)
    first = make_output(group, {"n2-0": ("a", 1), "n2-1": ("b", 1)})
    assert [(c.index, c.finish_reason) for c in first.outputs] == [(0, "stop"), (1, None)]
    seqs[1].append_token(6)
    later = make_output(group, {"n2-1": ("c", 1)})
    assert [(c.index, c.token_ids) for c in later.outputs] == [(1, [6])]


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_equal_transformers_log_softmax(chunked, model_dir, prompts, llm):
    from transformers import AutoModelForCausalLM

    ids = prompts[13]  # 135 tokens: several chunks of 16 when chunked
    engine = (
        LLM(max_num_batched_tokens=16, long_prefill_token_threshold=16, num_kv_blocks=64)
        if chunked
        else llm
    )
    out = engine.generate(
        [{"prompt_token_ids": ids}],
        SP(max_tokens=2, temperature=0, prompt_logprobs=3),
        use_tqdm=False,
    )[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        entry = plp[p]
        assert entry[ids[p]] == pytest.approx(float(ref[p - 1, ids[p]]), abs=2e-3)
        top = ref[p - 1].topk(3)
        for v, i in zip(top.values.tolist(), top.indices.tolist()):
            assert entry[i] == pytest.approx(v, abs=2e-3)
        assert len(entry) <= 4


def test_generate_refuses_a_bad_flag_before_loading_the_model(tmp_path, capsys):
    from deploy.cli import main as cli_main

    missing = tmp_path / "no-such-model"  # loading it would fail with a different error
    assert (
        cli_main(["generate", "--prompt", "hi", "--max-tokens", "-3", "--model", str(missing)]) == 2
    )
    assert "max_tokens=-3" in capsys.readouterr().err
