"""The serving benchmark's workload: what makes its comparisons fair."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import peers  # noqa: E402
import serve_bench as sb  # noqa: E402


def test_each_replay_sends_new_prompts_of_the_same_lengths(model_dir, tmp_path):
    # A server's prefix cache would serve a later rate's prompts from an earlier rate's
    # KV if the text repeated (vLLM's did: 31% hits, and its attainment rose with load).
    trace = tmp_path / "trace.csv"  # the trace's format; the real one lives outside the repo
    rows = [f"2023-11-16 18:15:{i:02d}.5,{200 + 40 * i},{10 + i}" for i in range(13)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    cfg = sb.BenchConfig(base_url="http://unused", model="m", tokenizer=str(model_dir),
                         trace=str(trace), window_start=0, num_requests=12, rates=[1.0, 2.0])
    first, second = sb.build_workload(cfg, 1.0, replay=0), sb.build_workload(cfg, 1.0, replay=1)
    assert [r.prompt_tokens for r in first] == [r.prompt_tokens for r in second]
    assert [r.max_tokens for r in first] == [r.max_tokens for r in second]
    assert [r.arrival_s for r in first] == [r.arrival_s for r in second]
    assert not {r.prompt for r in first} & {r.prompt for r in second}
    assert [r.prompt for r in sb.build_workload(cfg, 1.0, replay=0)] == [r.prompt for r in first]
    # Twice the rate: the same pattern, twice as fast; the 13th row ends the 12-request span.
    assert [2 * r.arrival_s for r in sb.build_workload(cfg, 2.0)] == pytest.approx(
        [r.arrival_s for r in first])
    assert first[-1].arrival_s == pytest.approx(11 / 12 * 12 / 1.0)


def test_host_factor_scales_slos_up_and_rates_down():
    args = peers.parse_args([])
    slow = {"vllm": {"stream1_ms_per_step": 2 * peers.REFERENCE_STREAM1_MS}}
    factor = peers.host_factor(args, slow)
    assert factor["k"] == 2.0
    s = peers.scaled(args, factor["k"])
    assert (s.slo_ttft_s, s.slo_tpot_s) == (2 * args.slo_ttft_s, 2 * args.slo_tpot_s)
    assert s.rates == [r / 2 for r in args.rates]
    assert s.max_rate_s == 2 * args.max_rate_s
    # A faster host than the reference keeps the SLOs and rates.
    fast = {"vllm": {"stream1_ms_per_step": peers.REFERENCE_STREAM1_MS / 2}}
    assert peers.host_factor(args, fast)["k"] == 1.0
    assert peers.host_factor(peers.parse_args(["--host-factor", "1.5"]), None)["k"] == 1.5
    assert peers.host_factor(args, None)["k"] == 1.0
    for bad in ("fast", "0", "-2"):
        with pytest.raises(SystemExit):
            peers.parse_args(["--host-factor", bad])
