"""Where one engine step's time goes, packed weights against the fp32 path (``python -m
bench.step_profile``; about 3 minutes).

For each engine (the embedded GGUF with ``quantization: auto``, packed, and ``none``, fp32;
both loaded, measured in ``--rounds`` rounds that alternate them, each figure the median of
the rounds) and each step shape, the mean of ``--steps`` steps driven through
``LLMEngine.step``, split
by the engine's own step record (:class:`engine.StepRecord`): the scheduler, the runner's
``prepare`` / ``forward`` / ``sample``, and the rest (request updates, detokenizing,
outputs). The forward is split further in place, by timing its calls as they run:

* ``products``: every linear layer's call (packed or fp32, the LM head included);
* ``attention``: the CPU kernels' decode and prefill attention calls;
* ``rest of forward``: the forward minus those two: norms, RoPE, the cache writes, the
  embedding, and the dispatch between them (Python, ctypes).

A decode step of a packed model runs all its layers in one C call
(:mod:`engine.quant.decode_stack`), which cannot be split from Python: the split is
measured with the model's Python layers, and ``one-call step`` is the same shape's step
with the C call, as the engine runs it. Shapes: one sequence decoding (128 tokens of
context), 8 sequences decoding, 32 decoding, and one 512-token prefill chunk. Output: a
table and ``bench/results/step_profile.json`` with the run record. Streaming is not in these
steps: ``bench.peers``' packed-weights phase measures the same decode served over HTTP.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from bench.toolkit import RESULTS, cli
from bench.toolkit import report as rp
from bench.toolkit.steps import split_ms

SHAPES = (
    ("decode x1", 1, 128, 0),
    ("decode x8", 8, 128, 0),
    ("decode x32", 32, 128, 0),
    ("prefill 512", 1, 0, 512),
)
"""(name, sequences, context tokens each, prefill tokens of the one chunk)."""


OFFSETS = {"py": 0, "c": 5003}
"""Token-id offsets of the two runs of a shape (and the round's ``salt`` another): other
prompts each time, so that no prefix is cached."""


class _Timers:
    """Sums the wall time of the linear layers' and the attention kernels' calls while
    installed (in situ: the step's own calls, on its own tensors)."""

    def __init__(self, runner) -> None:
        from engine.cpu.linear import PackedLinear
        from engine.quant.linear import QuantLinear

        self.products = self.attention = 0.0
        self._patched = []
        for cls in (QuantLinear, PackedLinear, torch.nn.Linear):
            self._wrap(cls, "forward", "products")
        kernels = runner.attention.cpu_kernels
        if kernels is not None:
            for name in ("decode_attention", "prefill_attention"):
                self._wrap(type(kernels), name, "attention")

    def _wrap(self, cls, name: str, bucket: str) -> None:
        orig = cls.__dict__[name]

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                setattr(self, bucket, getattr(self, bucket) + time.perf_counter() - t0)

        setattr(cls, name, timed)
        self._patched.append((cls, name, orig))

    def remove(self) -> None:
        for cls, name, orig in self._patched:
            setattr(cls, name, orig)


def _run_shape(llm, seqs, context, chunk, steps, tag, timers=None, salt=0):
    """``(record, products s, attention s)`` of ``steps`` steps of the shape (after warm-up
    steps); the seconds are ``timers``' for that step (0 without timers)."""
    from engine import SamplingParams

    engine = llm.llm_engine
    records = []
    last = [0.0, 0.0]

    def record(r) -> None:
        now = [timers.products, timers.attention] if timers else [0.0, 0.0]
        records.append((r, now[0] - last[0], now[1] - last[1]))
        last[:] = now

    engine.add_step_listener(record)
    try:
        if chunk:
            used = []
            for r in range(steps + 1):
                prompt = [
                    1000 + (r * 7919 + j * 13 + OFFSETS[tag] + salt * 10007) % 30000
                    for j in range(chunk)
                ]
                sp = SamplingParams(max_tokens=1, temperature=0)
                engine.add_request(f"{tag}p{r}", {"prompt_token_ids": prompt}, sp)
                n = len(records)
                while engine.has_unfinished_requests():
                    engine.step()
                used.append(records[n])
            return used[1:]
        sp = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
        for i in range(seqs):
            prompt = [
                1000 + (i * 7919 + j * 13 + OFFSETS[tag] + salt * 10007) % 30000
                for j in range(context)
            ]
            engine.add_request(f"{tag}d{i}", {"prompt_token_ids": prompt}, sp)
        while engine.has_unfinished_requests():
            engine.step()
        decode = [x for x in records if x[0].num_decodes == seqs and x[0].num_prefill_tokens == 0]
        return decode[4 : 4 + steps]
    finally:
        engine.step_listeners.remove(record)


def profile_shape(llm, seqs: int, context: int, chunk: int, steps: int, salt: int = 0) -> dict:
    """The shape's step split; the products and attention measured in situ on the Python
    layers (a decode step's one C call cannot be split), and the step with the one-call
    decode stack beside it where the model has one."""
    runner = llm.llm_engine.runner
    stack, runner.decode_stack = runner.decode_stack, None
    timers = _Timers(runner)
    try:
        rows = _run_shape(llm, seqs, context, chunk, steps, "py", timers, salt)
    finally:
        timers.remove()
        runner.decode_stack = stack
    records = [r for r, _, _ in rows]
    split = split_ms(records)
    split["products"] = 1000 * sum(p for _, p, _ in rows) / len(rows)
    split["attention"] = 1000 * sum(a for _, _, a in rows) / len(rows)
    split["rest of forward"] = split["forward"] - split["products"] - split["attention"]
    split["steps"] = len(records)
    split["one-call step"] = None
    if stack is not None and not chunk:
        rows = _run_shape(llm, seqs, context, chunk, steps, "c", None, salt)
        split["one-call step"] = split_ms([r for r, _, _ in rows])["step"]
    return split


def run(args) -> dict:
    """Both engines loaded together; each shape measured in ``--rounds`` rounds that
    alternate the engines' order (this host's speed drifts by more than the differences);
    each figure the median over the rounds."""
    from engine import LLM

    llms = {q: LLM(quantization=q, num_kv_blocks=1024, max_num_seqs=64) for q in ENGINES}
    result: dict = {
        "engines": {
            q: {"weights": llms[q].llm_engine.runner.weights.describe(), "shapes": {}}
            for q in ENGINES
        }
    }
    for name, seqs, ctx, chunk in SHAPES:
        rounds: dict[str, list[dict]] = {q: [] for q in ENGINES}
        for r in range(args.rounds):
            for q in ENGINES[:: 1 if r % 2 == 0 else -1]:
                rounds[q].append(profile_shape(llms[q], seqs, ctx, chunk, args.steps, salt=r))
        for q in ENGINES:
            runs = rounds[q]
            result["engines"][q]["shapes"][name] = {
                k: None if runs[0][k] is None else statistics.median(x[k] for x in runs)
                for k in runs[0]
            } | {"rounds": runs}
        print(f"[step_profile] {name} done", flush=True)
    del llms
    gc.collect()
    return result


ENGINES = ("auto", "none")


COLUMNS = (
    "one-call step",
    "step",
    "schedule",
    "prepare",
    "products",
    "attention",
    "rest of forward",
    "sample",
    "other",
)


def table(result: dict) -> list[str]:
    lines = [
        "| weights | shape | " + " | ".join(COLUMNS) + " |",
        "|---|---|" + "---:|" * len(COLUMNS),
    ]
    for e in result["engines"].values():
        for name, s in e["shapes"].items():
            cells = ["-" if s[c] is None else f"{s[c]:.2f}" for c in COLUMNS]
            lines.append(f"| {e['weights']} | {name} | " + " | ".join(cells) + " |")
    return lines + [
        "",
        "Milliseconds per step (means). `step` and its split run the model's Python layers, "
        "the products and attention timed in place; `one-call step` is the same decode with "
        "all layers in one C call (the default where the model has it).",
    ]


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("bench.step_profile", __doc__)
    p.add_argument("--steps", type=int, default=16, help="steps averaged per shape and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds alternating the engines")
    cli.add_out(p, str(RESULTS / "step_profile.json"), "the result file")
    args = p.parse_args(argv)
    cli.expected("step_profile", 180)
    t0 = time.monotonic()
    result = run(args)
    result["wall_s"] = time.monotonic() - t0
    rp.write_report(args.out, result, "\n".join(table(result)), md_file=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
