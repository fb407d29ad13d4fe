"""``iterserve simulate --search`` and ``--ablate``: many simulated runs, one answer each.

Search: the fewest replicas, then the engine settings (token budget, chunk size,
``max_num_seqs``) that meet :data:`deploy.sim.report.ATTAINMENT` in every class. Replicas
first, with the config's settings (attainment rises with replicas, so doubling then
bisection finds the least), then a grid of settings at one replica fewer, and fewer again
while some setting meets the SLOs; at the count found, the setting whose worst class does
best. Runs are independent and go to a process pool; each is deterministic, so the
answer does not depend on the pool.

Ablate: every TPOT guard rule (:data:`policies.slo_guard.RULES`) switched off alone, at
each rate, against all on.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from deploy.config import ServiceConfig
from deploy.sim.report import ATTAINMENT, all_classes_meet
from deploy.sim.runs import simulate, with_engine
from deploy.sim.trace import TraceSpec
from policies.slo_guard import RULES

Setting = tuple[tuple[str, Any], ...]
"""Engine fields to override, as sorted ``(name, value)`` pairs (hashable)."""


def _evaluate(job: tuple[ServiceConfig, Any, TraceSpec, str, int]) -> dict[str, Any]:
    return simulate(*job)[1]


class Runner:
    """Runs configs in a process pool, remembering results (a config runs once)."""

    def __init__(
        self,
        base: ServiceConfig,
        cost,
        spec: TraceSpec,
        routing: str,
        seed: int,
        workers: int | None = None,
    ) -> None:
        self.base, self.cost, self.spec, self.routing, self.seed = base, cost, spec, routing, seed
        self.pool = ProcessPoolExecutor(workers or max(1, min(8, os.cpu_count() or 1)))
        self.done: dict[tuple[int, Setting], dict[str, Any]] = {}

    def config(self, replicas: int, setting: Setting) -> ServiceConfig:
        return with_engine(self.base, {"num_replicas": replicas}, **dict(setting))

    def run(self, keys: list[tuple[int, Setting]]) -> list[dict[str, Any]]:
        todo = [k for k in dict.fromkeys(keys) if k not in self.done]
        jobs = [(self.config(n, s), self.cost, self.spec, self.routing, self.seed) for n, s in todo]
        for key, summary in zip(todo, self.pool.map(_evaluate, jobs)):
            self.done[key] = summary
            print(
                f"  {key[0]:>3} replicas {dict(key[1]) or '(config as given)'}: "
                f"worst class {worst(summary):.1%}",
                flush=True,
            )
        return [self.done[k] for k in keys]


def worst(summary: dict[str, Any]) -> float:
    return min(c["attainment"] for c in summary["classes"].values())


def grid(engine) -> list[Setting]:
    """Settings around the config's: half, same and double the token budget and
    ``max_num_seqs``, each with no chunk cap and with a quarter-budget cap."""
    out = []
    for b, s in itertools.product(
        (
            engine.max_num_batched_tokens // 2,
            engine.max_num_batched_tokens,
            engine.max_num_batched_tokens * 2,
        ),
        (max(1, engine.max_num_seqs // 2), engine.max_num_seqs, engine.max_num_seqs * 2),
    ):
        for chunk in (None, max(engine.block_size, b // 4)):
            out.append(
                (
                    ("long_prefill_token_threshold", chunk),
                    ("max_num_batched_tokens", max(engine.block_size, b)),
                    ("max_num_seqs", s),
                )
            )
    return out


def fewest_replicas(r: Runner, limit: int) -> int | None:
    """The least replica count that meets the SLOs with the config's own settings."""
    n, last_bad = 1, 0
    while not all_classes_meet(r.run([(n, ())])[0]):
        last_bad = n
        if n >= limit:
            return None
        n = min(limit, n * 2)
    while n - last_bad > 1:
        mid = (n + last_bad) // 2
        if all_classes_meet(r.run([(mid, ())])[0]):
            n = mid
        else:
            last_bad = mid
    return n


def search(r: Runner, limit: int) -> tuple[int, Setting, dict[str, Any]] | None:
    """(replicas, setting, its summary) of the cheapest plan found; None if even
    ``limit`` replicas miss."""
    n = fewest_replicas(r, limit)
    if n is None:
        return None
    settings = grid(r.base.engine)
    while n > 1:
        fewer = [
            s
            for s, summ in zip(settings, r.run([(n - 1, s) for s in settings]))
            if all_classes_meet(summ)
        ]
        if not fewer:
            break
        n -= 1
    candidates = [((), r.done[(n, ())])] if (n, ()) in r.done else []
    candidates += [(s, summ) for s, summ in zip(settings, r.run([(n, s) for s in settings]))]
    meeting = [(s, summ) for s, summ in candidates if all_classes_meet(summ)]
    setting, summary = max(meeting, key=lambda c: worst(c[1]))
    return n, setting, summary


def snippets(config: ServiceConfig, n: int, setting: Setting) -> tuple[str, str]:
    """The plan as ``iterserve serve --config`` YAML and as the Helm chart's values."""
    engine = {k: v for k, v in setting if v is not None}
    fields: dict[str, Any] = {"num_replicas": n}
    if config.replica_num_gpus:
        fields["replica_num_gpus"] = config.replica_num_gpus
    if engine:
        fields["engine"] = engine
    service = yaml.safe_dump(fields, sort_keys=False)
    return service, yaml.safe_dump({"config": fields}, sort_keys=False)


def search_command(
    args: argparse.Namespace, config: ServiceConfig, cost, specs: list[TraceSpec]
) -> int:
    """Search at the first of ``specs`` (one trace window per ``--rate-scale``)."""
    spec = specs[0]
    print(
        f"searching: up to {args.max_replicas} replicas, then {len(grid(config.engine))} "
        "engine settings per replica count"
    )
    r = Runner(config, cost, spec, args.routing, args.seed)
    try:
        found = search(r, args.max_replicas)
    finally:
        r.pool.shutdown()
    if found is None:
        print(f"no plan: {args.max_replicas} replicas miss {ATTAINMENT:.0%} attainment")
        return 1
    n, setting, summary = found
    service, helm = snippets(config, n, setting)
    print(
        f"\n{n} replica(s); every class at >= {ATTAINMENT:.0%} "
        f"(worst {worst(summary):.1%}).\n\nServiceConfig (iterserve serve --config):\n"
        f"{service}\nHelm values:\n{helm}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "replicas": n,
                    "setting": dict(setting),
                    "summary": summary,
                    "tried": [
                        {"replicas": k[0], "setting": dict(k[1]), "worst": worst(v)}
                        for k, v in r.done.items()
                    ],
                },
                indent=1,
            )
            + "\n"
        )
    return 0


def ablate_command(
    args: argparse.Namespace, config: ServiceConfig, cost, specs: list[TraceSpec]
) -> int:
    """Every rule off alone, against all on, at each of ``specs``."""
    if not config.engine.tpot_slo_guard:
        raise ValueError("--ablate needs the TPOT guard on (engine.tpot_slo_guard)")
    variants = [("all rules", ())] + [(f"no {rule}", (rule,)) for rule in RULES]
    results: dict[str, list[dict]] = {}
    for spec in specs:
        k = spec.rate_scale
        r = Runner(config, cost, spec, args.routing, args.seed)
        keys = [(config.num_replicas, (("tpot_slo_guard_rules_off", off),)) for _, off in variants]
        print(f"rate x{k:g}: {len(variants)} variants")
        for (name, _), summary in zip(variants, r.run(keys)):
            results.setdefault(name, []).append(summary | {"rate_scale": k})
        r.pool.shutdown()
    print("\n" + ablation_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def ablation_table(results: dict[str, list[dict]]) -> str:
    """Markdown: per variant, each class's attainment at each rate, and goodput."""
    base = results["all rules"]
    classes = list(base[0]["classes"])
    head = (
        "| variant | "
        + " | ".join(f"{c} x{s['rate_scale']:g}" for s in base for c in classes)
        + " | goodput (req/s) |"
    )
    lines = [head, "|---|" + "---:|" * (len(base) * len(classes) + 1)]
    for name, runs in results.items():
        cells = []
        for s, b in zip(runs, base):
            for c in classes:
                a, a0 = s["classes"][c]["attainment"], b["classes"][c]["attainment"]
                cells.append(f"{a:.1%}" if name == "all rules" else f"{a:.1%} ({a - a0:+.1%})")
        good = max((s["offered_rps"] for s in runs if all_classes_meet(s)), default=None)
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {'-' if good is None else f'{good:.3f}'} |"
        )
    return "\n".join(lines)
