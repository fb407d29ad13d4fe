"""The offline throughput benchmark's markdown report on stdout (``bench/engine_throughput.py``):
the workload, the systems, the targets, the decode sweep and greedy agreement, one table each.
"""

from __future__ import annotations

from report import fmt
from throughput_aggregate import TARGETS, median


def _print_header(report: dict) -> None:
    tr, wl = report["trace"], report["workload"]
    print()
    print(
        f"## iterserve engine throughput ({'quick' if report['quick'] else 'full'} run, "
        f"{report['runs']} run(s), SmolLM2-135M-Instruct fp32, "
        f"{report['machine']['cpu_count']} CPUs)"
    )
    print()
    print(f"Workload: {tr['attribution']}.")
    print(
        f"Window: {tr['window']}. Prompt len = {tr['prompt_len']}; output len = "
        f"{tr['output_len']}; prompt ids {tr['prompt_token_ids']}."
    )
    print(
        f"{wl['num_requests']} requests, {wl['prompt_tokens_total']} prompt tokens "
        f"(p50 {wl['prompt_len_p50']}, max {wl['prompt_len_max']}), "
        f"{wl['output_tokens_total']} output tokens (p50 {wl['output_len_p50']}, "
        f"max {wl['output_len_max']})."
    )
    print()


def _system_notes(s: dict) -> str:
    notes = []
    if s["errors"]:
        notes.append(f"ERROR: {s['errors'][0][:160]}")
    if "output_tokens_computed" in s:
        notes.append(
            f"computed {s['output_tokens_computed'][0]} output tokens for "
            f"{s.get('output_tokens')} useful"
        )
    if "preemptions" in s and any(s["preemptions"]):
        notes.append(f"preemptions {s['preemptions']}")
    if "ttft_s_p50" in s:
        notes.append(f"TTFT p50 {fmt(median(s['ttft_s_p50']), '.2f')} s")
    return "; ".join(notes)


def _print_systems(report: dict) -> None:
    print(
        "| system | output tok/s (median) | output tok/s per run | total tok/s | wall s "
        "| peak RSS MiB | own cores used | other load (cores) per run | notes |"
    )
    print("|---|---:|---|---:|---:|---:|---|---|---|")
    for name, s in report["systems"].items():
        per = ", ".join(fmt(x, ".1f") for x in s["output_tok_s_runs"])
        print(
            f"| {name} | {fmt(s['output_tok_s_median'], '.1f')} | {per} | "
            f"{fmt(s['total_tok_s_median'], '.1f')} | {fmt(s['wall_s_median'], '.1f')} | "
            f"{fmt(s['peak_rss_mib_max'], '.0f')} | "
            f"{', '.join(fmt(x, '.2f') for x in s['own_cores_runs'])} | "
            f"{', '.join(fmt(x, '.2f') for x in s['foreign_cores_runs'])} | "
            f"{_system_notes(s)} |"
        )
    print()
    print(
        "Peak RSS: ru_maxrss of each system's own subprocess (weights + KV cache + "
        "activations), max over runs. Own cores: the worker's CPU seconds / wall in the timed "
        "section (how parallel it really ran). Other load: average cores other processes "
        "kept busy "
        "during the timed section (/proc/stat minus this worker); well above 0 means the "
        f"numbers are contended. torch threads per worker: {report['machine']['torch_threads']}."
    )
    print()


def _print_targets(report: dict, at64: dict | None) -> None:
    if report["ratios"] or at64:
        print("| metric | measured | per run | target | met |")
        print("|---|---:|---|---:|---|")
    for key, r in report["ratios"].items():
        per = ", ".join(fmt(x, ".2f") for x in r["per_run"])
        target = "—" if r["target"] is None else f"≥{r['target']}x"
        print(
            f"| {key.replace('_', ' ')} | {fmt(r['median'], '.2f')}x | {per} | "
            f"{target} | {fmt(r['met'], '')} |"
        )
    if at64:
        pct, sp = at64["pct_roofline"], at64["sched_prep_pct"]
        print(
            f"| decode % of roofline at 64 seqs | {pct:.1f}% | | "
            f"≥{TARGETS['decode_pct_roofline_at_64']:.0f}% | "
            f"{pct >= TARGETS['decode_pct_roofline_at_64']} |"
        )
        print(
            f"| scheduling+prep % of step at 64 seqs | {sp:.1f}% | | "
            f"≤{TARGETS['sched_prep_pct_at_64']:.0f}% | "
            f"{sp <= TARGETS['sched_prep_pct_at_64']} |"
        )
    print()


def _sweep_row(p: dict, plain: dict) -> str:
    b = p["breakdown_ms"]
    q = plain.get(p["num_seqs"])
    vs = "—" if q is None else f"{q['tok_s']:.1f} ({p['tok_s'] / q['tok_s']:.2f}x)"
    return (
        f"| {p['num_seqs']} | {p['tok_s']:.1f} | {p['pct_roofline']:.1f} | "
        f"{p['step_ms_mean']:.1f} | {b['schedule']:.2f} | {b['prepare']:.2f} | "
        f"{b['forward']:.1f} | {b['sample']:.2f} | {b['other']:.2f} | "
        f"{p['sched_prep_pct']:.1f} | {p['outside_forward_pct']:.1f} | "
        f"{fmt(p['foreign_cores'], '.2f')} | {vs} |"
    )


def _print_sweep(report: dict, sw: dict) -> None:
    if sw.get("error"):
        print(f"Decode sweep ERROR: {sw['error']}")
        return
    if not sw:
        return
    g = sw["gemm"]
    print(
        f"Decode sweep (iterserve, {sw['prompt_len']}-token prompts, pure-decode steps "
        f"only). Roofline: fp32 GEMM {g['gflop_s']:.1f} GFLOP/s (torch.mm {g['n']}x{g['n']}, "
        f"median of {g['reps']}) / (2 x {sw['num_params'] / 1e6:.1f} M params) = "
        f"{sw['roofline_tok_s']:.0f} tok/s."
    )
    print()
    plain = {
        p["num_seqs"]: p for p in (report.get("decode_sweep_noprepack") or {}).get("points", [])
    }
    print(
        "| seqs | decode tok/s | % roofline | step ms (mean) | schedule ms | prepare ms "
        "| forward ms | sample ms | other ms | sched+prep % | outside forward % "
        "| other load (cores) | tok/s without prepack (ratio) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p in sw["points"]:
        print(_sweep_row(p, plain))
    print()


def _print_agreement(report: dict) -> None:
    ag = report.get("greedy_agreement") or {}
    if not ag:
        return
    print("Greedy agreement (run 1 tokens; fp32, different batch shapes may flip near-ties):")
    print()
    print("| pair | identical requests | first divergence positions |")
    print("|---|---:|---|")
    for pair, a in ag.items():
        pos = a["first_divergence_positions"]
        shown = ", ".join(map(str, pos[:12])) + (" ..." if len(pos) > 12 else "")
        print(f"| {pair} | {a['identical']}/{a['requests']} | {shown or '—'} |")
    print()


def print_report(report: dict) -> None:
    """The whole report as markdown on stdout."""
    _print_header(report)
    _print_systems(report)
    sw = report.get("decode_sweep") or {}
    at64 = next((p for p in sw.get("points", []) if p["num_seqs"] == 64), None)
    _print_targets(report, at64)
    _print_sweep(report, sw)
    _print_agreement(report)
