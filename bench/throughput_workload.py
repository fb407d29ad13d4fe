"""The offline throughput benchmark's inputs (``bench/engine_throughput.py``): the trace window
made into token-id prompts and output lengths, and each system's config (also the decode
sweep's), all from the command line's options.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
from pathlib import Path

from workload import ATTRIBUTION, REPO, TOKEN_ID_RANGE, Lengths, read_trace


def _trace_info(args: argparse.Namespace, first: str, last: str, raw: list[tuple[int, int]]):
    """The report's description of the trace window and of how its lengths were scaled."""
    return {
        "file": os.path.relpath(args.trace, REPO),
        "attribution": ATTRIBUTION,
        "window": (
            f"rows {args.window_start}-{args.window_start + args.num_requests - 1} "
            f"({args.num_requests} requests, TIMESTAMP {first} .. {last}); arrival times "
            "ignored, all submitted at once"
        ),
        "prompt_len": f"round(ContextTokens / {args.prompt_scale:g}) "
        f"clamped to [1, {args.max_prompt}]",
        "output_len": f"round(GeneratedTokens / {args.output_scale:g}) "
        f"clamped to [1, {args.max_output}]",
        "prompt_scale": args.prompt_scale,
        "output_scale": args.output_scale,
        "max_prompt": args.max_prompt,
        "max_output": args.max_output,
        "prompt_token_ids": f"uniform in [{TOKEN_ID_RANGE[0]}, {TOKEN_ID_RANGE[1]}), "
        f"random.Random({args.seed})",
        "raw_context_tokens_total": sum(c for c, _ in raw),
        "raw_generated_tokens_total": sum(g for _, g in raw),
    }


def build_workload(args: argparse.Namespace) -> dict:
    """Read the trace window, scale the lengths and make deterministic prompt token ids."""
    if not Path(args.trace).is_file():
        raise SystemExit(
            f"trace not found: {args.trace} (the shipped ones are in deploy/sim/traces/)"
        )
    window = read_trace(args.trace, args.window_start, args.num_requests)[: args.num_requests]
    lengths = Lengths(args.prompt_scale, args.output_scale, 1, args.max_prompt, 1, args.max_output)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(*TOKEN_ID_RANGE) for _ in range(lengths.prompt(r.context_tokens))]
        for r in window
    ]
    out_lens = [lengths.output(r.generated_tokens) for r in window]
    raw = [(r.context_tokens, r.generated_tokens) for r in window]
    return {
        "prompts": prompts,
        "output_lens": out_lens,
        "trace": _trace_info(args, window[0].timestamp, window[-1].timestamp, raw),
    }


def workload_stats(wl: dict) -> dict:
    p = [len(x) for x in wl["prompts"]]
    o = wl["output_lens"]
    return {
        "num_requests": len(p),
        "prompt_tokens_total": sum(p),
        "output_tokens_total": sum(o),
        "prompt_len_p50": statistics.median(p),
        "prompt_len_max": max(p),
        "output_len_p50": statistics.median(o),
        "output_len_max": max(o),
    }


def _iterserve_config(args: argparse.Namespace) -> dict:
    return {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "kv_tokens": args.num_kv_blocks * args.block_size,
        "dtype": "float32",
        "cpu_weight_prepack": True,
    }


def _hf_generate_config(args: argparse.Namespace) -> dict:
    return {
        "batch_size": args.hf_batch_size,
        "batching": "static, trace order, left-padded with pad=eos, "
        "max_new_tokens = max L of the batch",
        "attn_implementation": "sdpa",
        "eos": "disabled (model.generation_config.eos_token_id=None), "
        "min_new_tokens = max_new_tokens",
        "dtype": "float32",
    }


def _hf_generate_batch_config(args: argparse.Namespace) -> dict:
    return {
        "api": args.hf_cb_api,
        "api_note": (
            "continuous_batching_context_manager + add_request(max_new_tokens=L_i, "
            "eos_token_id=-1): the manager generate_batch builds, with per-request lengths"
            if args.hf_cb_api == "manager"
            else "model.generate_batch(max_new_tokens = max L for all requests); "
            "only each request's own L tokens are counted"
        ),
        "attn_implementation": "sdpa (CB accepts sdpa, paged|eager or flash; "
        "no flash on CPU; paged|sdpa is deprecated in 5.2x)",
        "page_size": args.block_size,
        "num_blocks": args.num_kv_blocks,
        "kv_tokens": args.num_kv_blocks * args.block_size,
        "max_batch_tokens": args.max_num_batched_tokens,
        "max_requests_per_batch": args.max_num_seqs,
        "allow_block_sharing": False,
        "auto_switch_to_flash": False,
        "scheduler_type": "fifo",
        "default_compile_level": 0,
        "max_memory_percent": "default (0.6 on CPU): only a cap here, since num_blocks and "
        "max_batch_tokens are fixed",
        "dtype": "float32",
    }


def system_configs(args: argparse.Namespace) -> dict:
    configs = {
        "iterserve": _iterserve_config(args),
        "hf_generate": _hf_generate_config(args),
        "hf_generate_batch": _hf_generate_batch_config(args),
    }
    configs["iterserve_noprepack"] = {**configs["iterserve"], "cpu_weight_prepack": False}
    return configs


def sweep_config(args: argparse.Namespace, iterserve: dict) -> dict:
    """The decode sweep's config: iterserve's (``iterserve``) plus the sweep's own."""
    return {
        **iterserve,
        "batch_sizes": [int(x) for x in args.sweep_sizes.split(",")],
        "prompt_len": 16,
        "token_id_range": TOKEN_ID_RANGE,
        "steps": args.sweep_steps,
        "warm_steps": 2,
        "gemm_size": args.gemm_size,
        "gemm_reps": 3 if args.quick else 9,
        "seed": args.seed,
        "threads": args.threads,
    }
