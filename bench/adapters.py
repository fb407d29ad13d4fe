"""What LoRA adapters cost one engine step: 1, 4 and 16 distinct adapters against the base
model, 8 and 32 sequences decoding and one 512-token prefill step (``python -m
bench.adapters``; about 8 minutes, ``--quick`` about 2).

Engine
    ``LLM()`` with its defaults (the embedded GGUF, weights packed) and ``max_loras`` 16,
    ``max_cpu_loras`` 16. Adapters: 16 PEFT LoRA adapters of rank 16 on all seven
    projections (q, k, v, o, gate, up, down), random (``init_lora_weights=False``, each
    from its own seed), made once with ``peft`` from the model's directory
    (:func:`engine.model.loader.resolve_model_dir`) into a folder under the temporary
    directory and reused by later runs.

Configurations, per shape
    ``base``: no adapter, as the engine runs it (decode-only steps in the one C call of
    :mod:`engine.quant.decode_stack`); ``base, Python layers``: no adapter, the C call
    turned off (``runner.decode_stack = None`` for the sample), the path every step with an
    adapter takes; ``N adapters`` (1, 4, 16; 8 in place of 16 at 8 sequences, one each):
    every sequence has an adapter, the sequences spread evenly over N of them. The adapters
    sit in the lowest slots, so that a step's LoRA passes span N slots.

Shapes
    ``decode x8`` and ``decode x32``: that many sequences of 128 prompt tokens, run to a
    steady decode, then ``--steps`` decode-only steps timed after 4 more; ``prefill 512``: 16
    prompts of 32 tokens in one step (the prefill runs no C call: its ``base, Python
    layers`` is ``base``), ``--prefill-steps`` such steps. Every sample has prompts of its
    own, so that no prefix is cached.

Measurement
    A sample is one configuration's median step time (``StepRecord.seconds``: the whole
    ``LLMEngine.step``) over its steps. ``--rounds`` rounds each take one sample of every
    configuration, the order reversed every other round, so that the host's drift (20% and
    more between runs on a shared 2-core machine) falls on all of them alike. Reported per
    configuration: the median sample over the rounds and its spread (p25-p75, min-max); the
    ratio to ``base`` and to ``base, Python layers`` within each round, and the median and
    range of those ratios. Where the overhead goes: per round, ``base, Python layers`` less
    ``base`` (losing the C call) and ``N adapters`` less ``base, Python layers`` (the LoRA
    passes), their medians. Other processes' load during each sample is recorded beside it.

Output: a table, ``bench/results/adapters.json`` with the run record and
``bench/results/adapters.md``. Needs ``peft`` (to make the adapters).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import tempfile
import time
from pathlib import Path

from bench.toolkit import RESULTS, cli
from bench.toolkit import report as rp
from bench.toolkit.cpu_load import cpu_snapshot, foreign_cores
from bench.toolkit.steps import split_ms

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections every adapter adapts."""
RANK = 16
ALPHA = 16
"""``lora_alpha``: scale 1."""
NUM_ADAPTERS = 16
"""Adapters made; the largest N measured."""
ADAPTER_COUNTS = (1, 4, 16)

SHAPES = (
    ("decode x8", 8, 128, False),
    ("decode x32", 32, 128, False),
    ("prefill 512", 16, 32, True),
)
"""(name, sequences, prompt tokens each, a one-step prefill shape)."""

BASE, PYTHON = "base", "base, Python layers"

WARM_DECODES = 4
"""Decode-only steps skipped before a sample's timed ones."""
CONTENDED = 0.25
"""Other processes' average busy cores above which a sample is taken again: with 2 torch
threads on 2 cores, a neighbour that takes part of a core slows a step several-fold."""
RETRIES = 2


def make_adapters(model_dir: Path, count: int, seed: int) -> list[Path]:
    """``count`` random rank-:data:`RANK` PEFT adapters of the model in ``model_dir``, on
    :data:`TARGETS`, adapter ``i`` from seed ``seed * 1000 + i``; made once into a folder
    under the temporary directory (each written under a temporary name, then renamed),
    reused while it holds them."""
    root = Path(tempfile.gettempdir()) / "iterserve-bench-adapters"
    root /= f"{model_dir.name}-r{RANK}-a{ALPHA}-seed{seed}"
    paths = [root / f"a{i}" for i in range(count)]
    missing = [
        (i, p) for i, p in enumerate(paths) if not (p / "adapter_model.safetensors").is_file()
    ]
    if not missing:
        return paths
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    print(f"[adapters] making {len(missing)} adapters in {root}", flush=True)
    root.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=list(TARGETS),
        init_lora_weights=False,
        bias="none",
        task_type="CAUSAL_LM",
    )
    for i, path in missing:
        torch.manual_seed(seed * 1000 + i)
        peft_model = get_peft_model(model, config)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".a{i}-"))
        peft_model.save_pretrained(tmp)
        model = peft_model.unload()
        tmp.rename(path)
    return paths


_PROMPTS = itertools.count()


def _prompt(n: int) -> tuple[str, list[int]]:
    """A new prompt of ``n`` ordinary-vocabulary token ids and its request id: its first two
    tokens number it, so that no two prompts of a run share a cached prefix."""
    uid = next(_PROMPTS)
    head = [1000 + uid // 25000, 1000 + uid % 25000]
    return f"r{uid}", (head + [1000 + (uid * 7919 + j * 13) % 30000 for j in range(n)])[:n]


def _sample(llm, shape, loras, steps: int) -> dict:
    """One sample: the step records of ``steps`` steps of ``shape`` with the sequences
    spread over ``loras`` (empty: the base model)."""
    from engine import SamplingParams

    _, seqs, ctx, prefill = shape
    engine = llm.llm_engine
    records = []
    engine.add_step_listener(records.append)
    try:
        if prefill:
            used = []
            sp = SamplingParams(max_tokens=1, temperature=0)
            for _ in range(steps):
                n = len(records)
                _run(engine, seqs, ctx, sp, loras)
                used.append(records[n])
            return {"records": used}
        sp = SamplingParams(max_tokens=WARM_DECODES + steps + 4, temperature=0, ignore_eos=True)
        _run(engine, seqs, ctx, sp, loras)
        decode = [r for r in records if r.num_decodes == seqs and r.num_prefill_tokens == 0]
        return {"records": decode[WARM_DECODES : WARM_DECODES + steps]}
    finally:
        engine.step_listeners.remove(records.append)


def _run(engine, seqs: int, ctx: int, sp, loras) -> None:
    """Run ``seqs`` new ``ctx``-token prompts to the end, spread over ``loras`` in turn."""
    for i in range(seqs):
        lora = loras[i % len(loras)] if loras else None
        rid, ids = _prompt(ctx)
        engine.add_request(rid, {"prompt_token_ids": ids}, sp, lora_request=lora)
    while engine.has_unfinished_requests():
        engine.step()


class _SlotWidth:
    """The widest LoRA pass of the steps since :meth:`take` (the slots the projections'
    passes spanned), read at each step's ``prepare``."""

    def __init__(self, manager) -> None:
        self.widest = 0
        orig = manager.prepare

        def prepare(loras, seq_of_token):
            orig(loras, seq_of_token)
            onehot = manager.step.onehot
            if onehot is not None:
                self.widest = max(self.widest, onehot.shape[1])

        manager.prepare = prepare

    def take(self) -> int:
        width, self.widest = self.widest, 0
        return width


def measure(
    llm, shape, config, loras, steps: int, widths: _SlotWidth, retries: int = RETRIES
) -> dict:
    """One configuration's sample of ``shape``: median step ms, the split's means, the
    slots spanned and other processes' load. A sample during which other processes kept
    more than :data:`CONTENDED` cores busy is taken again, ``retries`` times at most
    (``tries``; ``contended``: the one kept was too)."""
    name, n, stack_on = config
    runner = llm.llm_engine.runner
    stack = runner.decode_stack
    tries = 0
    while True:
        tries += 1
        if not stack_on:
            runner.decode_stack = None
        widths.take()
        t0, c0 = time.perf_counter(), cpu_snapshot()
        try:
            recs = _sample(llm, shape, loras[:n], steps)["records"]
        finally:
            runner.decode_stack = stack
        foreign = foreign_cores(c0, cpu_snapshot(), time.perf_counter() - t0)
        if foreign is None or foreign <= CONTENDED or tries > retries:
            break
        time.sleep(1.0)  # a short burst of other work may be over by then
    split = split_ms(recs)
    return {
        "step_ms": 1000 * statistics.median(r.seconds for r in recs),
        "forward_ms": 1000 * statistics.median(dict(r.phases).get("forward", 0.0) for r in recs),
        "split_mean_ms": split,
        "steps": len(recs),
        "slots_spanned": widths.take(),
        "foreign_cores": foreign,
        "tries": tries,
        "contended": foreign is not None and foreign > CONTENDED,
    }


def _configs(shape) -> list[tuple[str, int, bool]]:
    """A shape's configurations: (name, distinct adapters, C decode call allowed). At most
    one adapter per sequence; a prefill step runs no C call, so that its ``base, Python
    layers`` is its ``base`` (left out)."""
    _, seqs, _, prefill = shape
    out = [(BASE, 0, True)] + ([] if prefill else [(PYTHON, 0, False)])
    for n in sorted({min(n, seqs) for n in ADAPTER_COUNTS}):
        out.append((f"{n} adapter{'s' if n > 1 else ''}", n, True))
    return out


def check_adapters_apply(llm, loras) -> dict:
    """Greedy tokens of one prompt under the base model and under the first adapter: the
    adapters are applied iff they differ."""
    from engine import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": _prompt(32)[1]}
    outs = llm.generate([prompt, prompt], sp, lora_request=[None, loras[0]], use_tqdm=False)
    base, adapted = (list(o.outputs[0].token_ids) for o in outs)
    return {"base": base, "adapter a0": adapted, "differ": base != adapted}


def run(args: argparse.Namespace) -> dict:
    from engine import LLM, LoRARequest
    from engine.model.loader import resolve_model_dir

    model_dir = resolve_model_dir(None)
    t0 = time.monotonic()
    paths = make_adapters(model_dir, NUM_ADAPTERS, args.seed)
    made_s = time.monotonic() - t0
    loras = [LoRARequest(f"a{i}", str(p)) for i, p in enumerate(paths)]
    llm = LLM(max_loras=NUM_ADAPTERS, max_cpu_loras=NUM_ADAPTERS)
    runner = llm.llm_engine.runner
    if runner.lora is None or runner.decode_stack is None:
        raise SystemExit("[adapters] the engine has no LoRA manager or no C decode call here")
    widths = _SlotWidth(runner.lora)
    applied = check_adapters_apply(llm, loras)
    # Warm-up, adapters loaded in order: N adapters take slots 0..N-1.
    for shape in SHAPES:
        for config in _configs(shape):
            measure(llm, shape, config, loras, 2, widths, retries=0)
    print(f"[adapters] warmed up ({time.monotonic() - t0:.0f} s)", flush=True)
    shapes: dict = {}
    for shape in SHAPES:
        configs = _configs(shape)
        steps = args.prefill_steps if shape[3] else args.steps
        rounds: dict[str, list[dict]] = {c[0]: [] for c in configs}
        for r in range(args.rounds):
            for config in configs[:: 1 if r % 2 == 0 else -1]:
                rounds[config[0]].append(measure(llm, shape, config, loras, steps, widths))
        shapes[shape[0]] = summarize(rounds)
        print(f"[adapters] {shape[0]} done ({time.monotonic() - t0:.0f} s)", flush=True)
    result = {
        "args": vars(args),
        "machine": {**rp.machine(), "torch": rp.package_version("torch")},
        "weights": runner.weights.describe(),
        "model_dir": str(model_dir),
        "adapters": {
            "count": NUM_ADAPTERS,
            "rank": RANK,
            "lora_alpha": ALPHA,
            "targets": list(TARGETS),
            "init": "peft init_lora_weights=False, seed * 1000 + i",
            "peft": rp.package_version("peft"),
            "folder": str(paths[0].parent),
            "made_s": made_s,
            "max_loras": NUM_ADAPTERS,
            "max_cpu_loras": NUM_ADAPTERS,
            "max_lora_rank": llm.llm_engine.config.max_lora_rank,
        },
        "adapters_apply": applied,
        "shapes": shapes,
    }
    del llm
    gc.collect()
    return result


def _spread(xs: list[float]) -> dict:
    return {
        "median": statistics.median(xs),
        "p25": rp.percentile(xs, 25),
        "p75": rp.percentile(xs, 75),
        "min": min(xs),
        "max": max(xs),
    }


def summarize(rounds: dict[str, list[dict]]) -> dict:
    """Per configuration: the samples' spread, and the per-round ratios to ``base`` and to
    ``base, Python layers`` (where measured) and the per-round overhead split."""
    out: dict = {}
    base = [s["step_ms"] for s in rounds[BASE]]
    py = [s["step_ms"] for s in rounds[PYTHON]] if PYTHON in rounds else None
    for name, samples in rounds.items():
        ms = [s["step_ms"] for s in samples]
        row = {
            "step_ms": _spread(ms),
            "forward_ms": statistics.median(s["forward_ms"] for s in samples),
            "slots_spanned": max(s["slots_spanned"] for s in samples),
            "foreign_cores_max": max((s["foreign_cores"] or 0.0) for s in samples),
            "ratio_to_base": _spread([a / b for a, b in zip(ms, base)]),
            "rounds": samples,
        }
        if py is not None:
            row["ratio_to_python_layers"] = _spread([a / b for a, b in zip(ms, py)])
            if name not in (BASE, PYTHON):
                row["overhead_ms"] = statistics.median(a - b for a, b in zip(ms, base))
                row["losing_c_call_ms"] = statistics.median(p - b for p, b in zip(py, base))
                row["lora_passes_ms"] = statistics.median(a - p for a, p in zip(ms, py))
        out[name] = row
    return out


def table(result: dict) -> list[str]:
    """The markdown report: the step times and ratios, then where the overhead goes."""
    rows = []
    for shape, configs in result["shapes"].items():
        for name, c in configs.items():
            s, rb = c["step_ms"], c["ratio_to_base"]
            rpy = c.get("ratio_to_python_layers")
            rows.append(
                [
                    shape,
                    name,
                    f"{s['median']:.2f}",
                    f"{s['p25']:.2f}-{s['p75']:.2f}",
                    f"{s['min']:.2f}-{s['max']:.2f}",
                    f"{rb['median']:.2f}x ({rb['min']:.2f}-{rb['max']:.2f})",
                    "-" if rpy is None else f"{rpy['median']:.2f}x",
                    str(c["slots_spanned"] or "-"),
                ]
            )
    head = [
        "shape",
        "configuration",
        "step ms",
        "p25-p75",
        "min-max",
        "/ base, per round (range)",
        "/ base, Python layers",
        "slots",
    ]
    split = []
    for shape, configs in result["shapes"].items():
        for name, c in configs.items():
            if "overhead_ms" not in c:
                continue
            over = c["overhead_ms"]
            split.append(
                [
                    shape,
                    name,
                    f"{over:.2f}",
                    f"{c['losing_c_call_ms']:.2f}",
                    f"{c['lora_passes_ms']:.2f}",
                    rp.pct(c["losing_c_call_ms"] / over if over > 0 else None),
                ]
            )
    args = result["args"]
    a = result["adapters"]
    samples = [x for s in result["shapes"].values() for c in s.values() for x in c["rounds"]]
    foreign = max((x["foreign_cores"] or 0.0) for x in samples)
    again = sum(x["tries"] > 1 for x in samples)
    kept = sum(x["contended"] for x in samples)
    applied = result["adapters_apply"]["differ"]
    return [
        f"Weights: {result['weights']}. Adapters: rank {a['rank']} on "
        f"{', '.join(t.removesuffix('_proj') for t in a['targets'])}, random "
        f"(peft {a['peft']}, `init_lora_weights=False`); max_loras {a['max_loras']}, "
        f"max_cpu_loras {a['max_cpu_loras']}. {args['rounds']} rounds, configurations "
        f"interleaved (order reversed every other round); a sample is the median of "
        f"{args['steps']} decode steps ({args['prefill_steps']} prefill steps). "
        f"Greedy tokens under adapter a0 {'differ' if applied else 'DO NOT differ'} "
        "from the base model's.",
        "",
        rp.table(head, rows, "llrrrrrr"),
        "",
        "Milliseconds per step (`LLMEngine.step`, all of it): the median sample over the "
        "rounds, and the samples' spread. The ratios are taken within each round, then their "
        "median (and range). `base` runs decode-only steps in one C call; `base, Python "
        "layers` is the same step without it, the path every step with an adapter takes; "
        "`slots`: the slots the LoRA passes spanned.",
        "",
        "Where the overhead over `base` goes (ms per step, medians of the per-round differences):",
        "",
        rp.table(
            [
                "shape",
                "configuration",
                "overhead",
                "losing the C call",
                "LoRA passes",
                "share of losing the C call",
            ],
            split,
            "llrrrr",
        ),
        "",
        f"Other processes kept at most {foreign:.2f} cores busy during a sample kept; "
        f"{again} of {len(samples)} samples were taken again (more than {CONTENDED} cores "
        f"busy), {kept} kept although still contended.",
    ]


SETUP_S = 45
"""Seconds to load the engine, check the adapters and warm up (making the adapters, on a
first run, adds about 20), on the 2-core host."""
PROMPTS_S = {"decode x8": 4.6, "decode x32": 20.0}
"""Seconds per round to prefill the prompts of a decode shape's samples (all its
configurations)."""
STEP_S = {"decode x8": 0.14, "decode x32": 0.36, "prefill 512": 2.15}
"""Seconds of one step of a shape in every configuration of a round."""


def expected_s(args: argparse.Namespace) -> float:
    per_round = 0.0
    for name, _, _, prefill in SHAPES:
        if prefill:
            per_round += args.prefill_steps * STEP_S[name]
        else:
            per_round += PROMPTS_S[name] + (WARM_DECODES + args.steps + 4) * STEP_S[name]
    return SETUP_S + args.rounds * per_round


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser("bench.adapters", __doc__)
    cli.add_quick(p, "a smoke run: 2 rounds of fewer steps (1-2 minutes)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 8; quick 2)")
    p.add_argument(
        "--steps", type=int, default=None, help="decode steps per sample (default 24; quick 8)"
    )
    p.add_argument(
        "--prefill-steps",
        type=int,
        default=None,
        help="prefill steps per sample (default 4; quick 2)",
    )
    cli.add_seed(p)
    cli.add_out(p, str(RESULTS / "adapters"), "stem of the .json and .md")
    args = p.parse_args(argv)
    for key, full, quick in (("rounds", 8, 2), ("steps", 24, 8), ("prefill_steps", 4, 2)):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cli.expected("adapters", expected_s(args), f"{args.rounds} rounds")
    t0 = time.monotonic()
    result = run(args)
    result["wall_s"] = time.monotonic() - t0
    rp.write_report(Path(args.out).with_suffix(".json"), result, "\n".join(table(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
