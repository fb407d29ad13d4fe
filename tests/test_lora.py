"""LoRA adapters (:mod:`engine.lora`): greedy output under each adapter equals transformers'
``generate`` on the weights peft merges (``merge_and_unload``), token for token, in batches
that mix the base model and several adapters; the prefix cache keeps each adapter's KV
apart; ``max_loras`` serialises adapters without starving any; adapter directories the
engine cannot serve are refused; ``max_cpu_loras`` keeps the most recently used."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.core.request import Request, RequestStatus
from engine.lora import AdapterError
from engine.lora.adapter import CONFIG_FILE, TARGETS, WEIGHTS_FILE
from tests.test_generation import CONFIGS, assert_matches_reference, greedy_reference
from tests.test_scheduler import distinct_prompt, fake_step, make_scheduler

MAX_TOKENS = 8
LENGTHS = (3, 17, 60, 135, 260, 440)
"""The prompts (conftest's) run under every adapter: the 440-token one is prefilled in
chunks under a 256-token step budget (the server's 512 with decodes in the step too).
Longer prompts would cost the references several seconds each."""
LONG = LENGTHS.index(440)
SERIAL = [0, 1, 2]
"""The prompts of the test that runs adapters one after the other (short: many steps)."""
ADAPTERS = {
    # Rank 8, below max_lora_rank (zero-padded in the slots), on two of the three attention
    # projections fused in qkv_proj; rsLoRA: scale lora_alpha / sqrt(r), not / r.
    "A": dict(r=8, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    # Rank 16 (max_lora_rank's default) on all seven projections of a decoder layer.
    "B": dict(r=16, lora_alpha=32, target_modules=list(TARGETS)),
}
SEEDS = {"A": 2, "B": 1}
"""torch seeds of the adapters' random weights: each changes the greedy output of every
prompt (checked by assert_adapters_change_output)."""
BASE = "base"
"""The references' key for the base model (no adapter)."""


def make_adapter(model_dir, path, seed: int, **lora_config) -> None:
    """Save to ``path`` a PEFT LoRA adapter of random weights for the model in ``model_dir``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # init_lora_weights=False: B random too (peft's default B = 0 would change nothing).
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_config))
    peft_model.save_pretrained(str(path))
    del peft_model, model
    gc.collect()


@pytest.fixture(scope="module")
def lora_prompts(prompts) -> list[list[int]]:
    out = [p for p in prompts if len(p) in LENGTHS]
    assert [len(p) for p in out] == list(LENGTHS)
    return out


@pytest.fixture(scope="module")
def loras(lora_dirs) -> dict[str, LoRARequest]:
    """The adapters of ADAPTERS (conftest's ``lora_dirs``)."""
    return {name: LoRARequest(name, path) for name, path in lora_dirs.items()}


@pytest.fixture(scope="module")
def refs(model_dir, lora_prompts, loras) -> dict[str, list]:
    """Per adapter (and BASE), transformers' greedy reference on the merged weights.

    On one thread: on a 2-core host that other work keeps busy, torch's two threads wait
    on each other, and a reference takes several times as long."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {BASE: greedy_reference(model_dir, lora_prompts, MAX_TOKENS)}
        for name, lora in loras.items():
            out[name] = greedy_reference(model_dir, lora_prompts, MAX_TOKENS, adapter=lora.path)
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def default_llm():
    """An engine of the default configuration, for the tests that need no other: the prefix
    cache's (the only one to run the LONG prompt on it) and the refused adapters'."""
    llm = LLM()
    yield llm
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def one_slot_llm():
    """One adapter per step, one kept in host memory (max_cpu_loras defaults to max_loras)."""
    llm = LLM(max_loras=1, max_cpu_loras=1)
    yield llm
    del llm
    gc.collect()


def generate(llm: LLM, prompts: list[list[int]], lora_request):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    return llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        params,
        use_tqdm=False,
        lora_request=lora_request,
    )


def assert_adapters_change_output(refs: dict[str, list]) -> None:
    """Each adapter's greedy output differs from the base model's on every prompt (else an
    engine ignoring the adapter, or applying another, could pass)."""
    for name in ADAPTERS:
        for i, (a, b) in enumerate(zip(refs[name], refs[BASE])):
            assert a[0] != b[0], f"adapter {name} leaves prompt {i}'s output: change SEEDS"
        other = [n for n in ADAPTERS if n != name]
        assert all(refs[name][i][0] != refs[n][i][0] for n in other for i in range(len(refs[n])))


def check_mixed(llm: LLM, prompts, loras, refs, names=(BASE, *ADAPTERS)):
    """Run every prompt under each of ``names`` in one ``generate`` call, interleaved (the
    same prompt under every adapter side by side); each output equals its reference."""
    jobs = [(i, name) for i in range(len(prompts)) for name in names]
    outs = generate(llm, [prompts[i] for i, _ in jobs], [loras.get(name) for _, name in jobs])
    for out in outs:
        assert out.error is None, out.error
    for name in names:
        got = [out for out, (_, n) in zip(outs, jobs) if n == name]
        print(f"{name}:")
        assert_matches_reference(got, refs[name])
    return outs


def check_blocks_free(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check()


MIXED_CONFIGS = {
    # The embedded GGUF's packed weights (engine.quant) under the adapters' fp32 updates.
    "packed": dict(),
    # fp32 nn.Linear weights.
    "fp32": dict(quantization="none"),
    # 60 blocks of 16 tokens and a 256-token step: preemption and chunked prefill.
    "small-kv-preemption": CONFIGS["small-kv-preemption"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MIXED_CONFIGS))
def test_mixed_batch_matches_merged_references(name, lora_prompts, loras, refs):
    assert_adapters_change_output(refs)
    llm = LLM(**MIXED_CONFIGS[name])
    engine = llm.llm_engine
    check_mixed(llm, lora_prompts, loras, refs)
    check_blocks_free(llm)
    fmt = engine.runner.weights.format
    assert fmt.startswith("gguf") != (name == "fp32"), fmt
    if name == "small-kv-preemption":
        assert engine.scheduler.num_preemptions > 0, "the small cache should force preemption"
        assert max(LENGTHS) > engine.config.max_num_batched_tokens  # a chunked prefill
    assert sorted(engine.list_loras()) == sorted(ADAPTERS)


@pytest.mark.slow
def test_prefix_cache_is_keyed_by_adapter(default_llm, lora_prompts, loras, refs):
    """The same long prompt under the base model, then adapter A, then A again: A finds no
    KV of the base model's, then its own."""
    assert_adapters_change_output(refs)
    llm = default_llm
    engine = llm.llm_engine
    i = LONG
    prompt = lora_prompts[i]
    bs = engine.block_manager.block_size
    whole_blocks = (len(prompt) - 1) // bs * bs

    def run(name, cached: int):
        """Generate under ``name``; the KV found cached (before the tokens: a wrong hit
        shows as a wrong count first)."""
        out = generate(llm, [prompt], loras.get(name))[0]
        assert out.num_cached_tokens == cached, f"{name}: {out.num_cached_tokens} cached"
        assert_matches_reference([out], [refs[name][i]])
        return out

    run(BASE, 0)
    first = run("A", 0)  # the base model's KV of the same tokens is not A's
    again = run("A", whole_blocks)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    run("B", 0)
    run(BASE, whole_blocks)
    check_blocks_free(llm)

    # remove_lora forgets one adapter; it loads again on its next use, with the same KV key.
    assert engine.list_loras() == ["A", "B"]
    assert engine.remove_lora("A") is True
    assert engine.list_loras() == ["B"]
    assert engine.remove_lora("A") is False
    reloaded = run("A", whole_blocks)
    assert reloaded.outputs[0].token_ids == first.outputs[0].token_ids
    assert engine.list_loras() == ["B", "A"]


@pytest.mark.slow
def test_adapter_path_spelling_reads_it_once(default_llm, lora_prompts, loras, refs):
    """An adapter's directory spelled with a trailing slash is the one kept under its plain
    spelling: read once, not again at every step."""
    engine = default_llm.llm_engine
    manager = engine.runner.lora
    engine.remove_lora("A")
    loads = manager.num_loads
    outs = generate(default_llm, lora_prompts[:2], LoRARequest("A", loras["A"].path + "/"))
    assert_matches_reference(outs, refs["A"][:2])
    assert manager.num_loads - loads == 1
    assert engine.list_loras()[-1] == "A"


@pytest.mark.slow
def test_max_loras_one_serialises_adapters(one_slot_llm, lora_prompts, loras, refs, monkeypatch):
    """With one slot, a batch interleaving A and B runs them one after the other (the
    base model's requests alongside), each output its reference's; with one adapter kept
    in host memory, each switch reads the other again."""
    llm = one_slot_llm
    manager = llm.llm_engine.runner.lora
    steps: list[set[str | None]] = []
    prepare = manager.prepare

    def recording_prepare(step_loras, seq_of_token):
        steps.append({lo.name if lo is not None else None for lo in step_loras})
        return prepare(step_loras, seq_of_token)

    monkeypatch.setattr(manager, "prepare", recording_prepare)
    loads = manager.num_loads
    prompts = [lora_prompts[i] for i in SERIAL]
    check_mixed(llm, prompts, loras, {k: [v[i] for i in SERIAL] for k, v in refs.items()})
    check_blocks_free(llm)
    adapters_per_step = [s - {None} for s in steps]
    assert max(len(s) for s in adapters_per_step) == 1
    assert {"A"} in adapters_per_step and {"B"} in adapters_per_step
    assert any(None in s and len(s) > 1 for s in steps), "base requests waited for adapters"
    # A and B alternate (the no-starvation rule): every switch reads the adapter again.
    switches = sum(
        1 for a, b in zip(adapters_per_step, adapters_per_step[1:]) if a and b and a != b
    )
    assert switches >= len(prompts)
    assert manager.num_loads - loads >= switches


# -- the scheduler's max_loras admission (no model) --------------------------------------


def adapter_request(rid: str, adapter: str | None, arrival: float, max_tokens: int = 4) -> Request:
    lora = LoRARequest(adapter, f"/adapters/{adapter}") if adapter else None
    return Request(
        rid,
        distinct_prompt(rid, 8),
        SamplingParams(max_tokens=max_tokens),
        arrival_time=arrival,
        max_tokens=max_tokens,
        lora=lora,
    )


def test_scheduler_max_loras_does_not_starve_a_waiting_adapter():
    """max_loras=1: X1 and X2 run with adapter X; Y1 (adapter Y) arrives and waits, and a
    new X request arrives at every step. Y1 runs as soon as X1 and X2 are done: no X request
    arriving after Y1 goes first, while base-model requests still do."""
    sched, clock = make_scheduler(max_loras=1, max_num_batched_tokens=64, max_num_seqs=16)
    x1 = adapter_request("x1", "X", clock(), max_tokens=4)
    x2 = adapter_request("x2", "X", clock(), max_tokens=6)
    sched.add(x1)
    sched.add(x2)
    fake_step(sched, clock)
    assert x1.status is x2.status is RequestStatus.RUNNING
    y1 = adapter_request("y1", "Y", clock(), max_tokens=4)
    sched.add(y1)
    base = adapter_request("base", None, clock() + 0.01)
    sched.add(base)
    later_x: list[Request] = []
    for step in range(40):
        x = adapter_request(f"x-late{step}", "X", clock() + 0.02)
        later_x.append(x)
        sched.add(x)
        slot_free = x1.is_finished and x2.is_finished
        out = fake_step(sched, clock)
        adapters = {s.request.lora.name for s in out.seqs if s.request.lora is not None}
        assert len(adapters) <= 1, adapters
        if y1.first_scheduled_time is None:
            assert not slot_free, "Y1 waited with X's slot free"
            assert all(r.first_scheduled_time is None for r in later_x), "an X overtook Y1"
        if y1.is_finished:
            break
    assert y1.is_finished, "Y1 starved"
    assert base.first_scheduled_time is not None
    assert base.first_scheduled_time < x2.finish_time, "the base request waited for Y1"
    # Y1 was admitted by the first step after X1 and X2 finished, before any later X.
    assert y1.first_scheduled_time == pytest.approx(x2.finish_time + 0.1)
    assert all(
        r.first_scheduled_time is None or r.first_scheduled_time > y1.first_scheduled_time
        for r in later_x
    )
    # Then the X stream goes on, and every request finishes.
    while sched.has_unfinished():
        fake_step(sched, clock)
    assert all(r.is_finished for r in later_x)


# -- adapter directories the engine refuses ----------------------------------------------


def write_adapter(path, config: dict, tensors: dict[str, torch.Tensor] | None) -> str:
    from safetensors.torch import save_file

    path.mkdir()
    (path / CONFIG_FILE).write_text(json.dumps(config))
    if tensors is not None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / WEIGHTS_FILE))
    return str(path)


@pytest.fixture(scope="module")
def bad_adapters(loras, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """Per case: an adapter directory the engine refuses and what its error names."""
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("bad_loras")
    good = loras["A"].path
    config = json.loads(Path(good, CONFIG_FILE).read_text())
    tensors = load_file(f"{good}/{WEIGHTS_FILE}")
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    big = {f"{q}.lora_A.weight": torch.randn(32, 576), f"{q}.lora_B.weight": torch.randn(576, 32)}
    narrow = {k: (v[:, :500] if ".lora_A." in k else v) for k, v in tensors.items()}
    return {
        "missing-directory": (str(root / "nowhere"), "is not a directory"),
        "no-weights": (
            write_adapter(root / "no-weights", config, None),
            f"{WEIGHTS_FILE} is missing",
        ),
        "rank-above-max": (
            write_adapter(root / "rank32", {**config, "r": 32}, big),
            "rank 32 .* above max_lora_rank 16",
        ),
        "dora": (write_adapter(root / "dora", {**config, "use_dora": True}, tensors), "DoRA"),
        "other-shape": (
            write_adapter(root / "narrow", config, narrow),
            r"A \(8, 500\) .* do not fit .* \[576, 576\] projection",
        ),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["missing-directory", "no-weights", "rank-above-max", "dora", "other-shape"]
)
def test_bad_adapter_is_refused(case, bad_adapters, default_llm, lora_prompts, loras, refs):
    path, message = bad_adapters[case]
    llm, engine = default_llm, default_llm.llm_engine
    engine.add_lora(loras["A"])
    manager = engine.runner.lora
    loads = manager.num_loads
    bad = LoRARequest("bad", path)
    with pytest.raises(AdapterError, match=message) as e:
        engine.add_lora(bad)
    assert isinstance(e.value, ValueError)
    # Under the name of a loaded adapter: that one stays.
    with pytest.raises(AdapterError, match=message):
        engine.add_lora(LoRARequest("A", path))
    with pytest.raises(ValueError, match=message):
        generate(llm, lora_prompts[:2], [loras["A"], bad])
    assert not engine.scheduler.has_unfinished()
    assert "bad" not in engine.list_loras()
    # A is still served, from memory.
    outs = generate(llm, lora_prompts[:2], loras["A"])
    assert_matches_reference(outs, refs["A"][:2])
    assert manager.num_loads == loads
    check_blocks_free(llm)


# -- host memory: max_cpu_loras ---------------------------------------------------------


@pytest.mark.slow
def test_max_cpu_loras_keeps_the_most_recently_used(one_slot_llm, lora_prompts, loras, refs):
    """max_cpu_loras=1, A and B used in turn: each evicts the other, and is read again."""
    llm = one_slot_llm
    engine = llm.llm_engine
    manager = engine.runner.lora
    for name in engine.list_loras():  # the engine is shared: start with none kept
        engine.remove_lora(name)
    loads = manager.num_loads
    subset = [0, 3]
    prompts = [lora_prompts[i] for i in subset]
    for k, name in enumerate(["A", "B", "A", "B"]):
        outs = generate(llm, prompts, loras[name])
        assert_matches_reference(outs, [refs[name][i] for i in subset])
        assert engine.list_loras() == [name]
        assert manager.num_loads - loads == k + 1, "the other adapter was not evicted"
    assert engine.remove_lora("B") is True
    assert engine.list_loras() == []
    assert engine.remove_lora("B") is False
    check_blocks_free(llm)
