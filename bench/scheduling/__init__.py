"""Scheduling benchmark: static vs continuous batching, chunked prefill, priority, admission.

Run from the repository root (it prints its expected duration first)::

    python -m bench.scheduling            # full run
    python -m bench.scheduling --quick    # smoke run (2 loads x 3 configs)

Workload: a window of the Azure LLM inference trace 2023, conversation service
(:mod:`bench.toolkit.workload`), replayed in real time through the in-process
``AsyncLLMEngine`` by the shared load generator (:mod:`bench.toolkit.loadgen`,
:class:`bench.toolkit.targets.EngineTarget`).
Lengths are divided by 8 (prompts clamped to [4, 1024], outputs to [2, 128]): the lengths
decide what static batching costs, since a request that arrives mid-batch waits out the
batch's remaining decode steps against the 2 s TTFT SLO, and /8 is the least scaling at
which a run fits here. Prompts are random token ids per row; every request is forced to
its output length (``ignore_eos``, greedy). Each row is interactive or batch (70/30,
fixed per row); SLOs are ``policies.DEFAULT_CLASSES`` (interactive TTFT 2 s / TPOT 0.5 s,
batch 60 s / 5 s).

Steps, one after another (each engine alone, warmed up first):

1. Capacity: a closed loop of ``--capacity-concurrency`` clients on cont-chunk-fixed;
   loads are multiples of it (``--capacity R`` skips it).
2. Sweep (:func:`run_config`): each config over ``--loads`` x capacity, open loop,
   ``--duration`` s of arrivals, cut off ``--drain`` s later (cut-off requests are misses;
   the table says how many could still have met their SLOs). A config that misses 90% at
   its lowest load gets a point at half that load, and ``--goodput-refine`` points halve
   each bracket. Goodput (DistServe): the highest offered rate with >= 90% of requests
   within both SLOs (refused requests are misses), interpolated inside its bracket.
3. Experiments: ``chunk`` (:func:`exp_chunk`), ``admission`` (from the sweep:
   admitted interactive attainment and SLO goodput at the highest load, on vs off) and
   ``priority`` (:func:`exp_priority`, lengths / ``--priority-scale``, its own
   capacity).

Configs (:data:`CONFIGS`): static (Orca's request-level baseline), cont-nochunk,
cont-chunk (FCFS, chunked prefill, the TPOT SLO guard as the server runs it), cont-chunk-fixed
(without the guard), priority, cont-chunk+adm and priority+adm (behind admission, as the
router runs it). Budget 128 tokens with chunking (a full step near the interactive TPOT SLO
here), 2048 without; max_num_seqs 64, 1024 KV blocks of 16 tokens.

Output: a markdown report on stdout and in ``bench/results/scheduling.md``,
``scheduling.json`` (``scheduling_quick.*`` with --quick) and
``scheduling_goodput.png``. Targets are printed beside the measurements, never asserted;
``other load`` is the cores other processes kept busy during each point.

Modules: :mod:`~bench.scheduling.sweep` (configs, capacity, the load sweep),
:mod:`~bench.scheduling.experiments` (chunk, admission, priority),
:mod:`~bench.scheduling.report` (targets, tables, plots) and
:mod:`~bench.scheduling.run` (the command line, the steps in order).
"""

from bench.scheduling.experiments import (
    PRIORITY_BATCH_MAX_WORK_SHARE,
    STEADY_TOKENS,
    admission_experiment,
    exp_chunk,
    exp_priority,
    one_run,
    run_variant,
    variants,
)
from bench.scheduling.report import TARGETS, markdown, plots, targets, targets_table
from bench.scheduling.run import (
    ENGINE_START_S,
    EXPERIMENTS,
    FULL_CONFIGS,
    QUICK_CONFIGS,
    amain,
    capacity_of,
    estimate_s,
    main,
    parse_args,
    problems_of,
    window,
)
from bench.scheduling.sweep import (
    CONFIGS,
    engine_config,
    measure_capacity,
    named_config,
    next_load,
    prediction_summary,
    run_config,
    run_point,
    slo_of,
)

__all__ = [
    "CONFIGS",
    "ENGINE_START_S",
    "EXPERIMENTS",
    "FULL_CONFIGS",
    "PRIORITY_BATCH_MAX_WORK_SHARE",
    "QUICK_CONFIGS",
    "STEADY_TOKENS",
    "TARGETS",
    "admission_experiment",
    "amain",
    "capacity_of",
    "engine_config",
    "estimate_s",
    "exp_chunk",
    "exp_priority",
    "main",
    "markdown",
    "measure_capacity",
    "named_config",
    "next_load",
    "one_run",
    "parse_args",
    "plots",
    "prediction_summary",
    "problems_of",
    "run_config",
    "run_point",
    "run_variant",
    "slo_of",
    "targets",
    "targets_table",
    "variants",
    "window",
]
