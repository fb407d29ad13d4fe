"""The offline throughput benchmark's transformers workers, each run in its own subprocess by
``bench/engine_throughput.py`` (``--worker NAME``, dispatched by ``bench/offline_workers.py``):
``model.generate`` on static batches (:func:`worker_hf_generate`) and continuous batching
(:func:`worker_hf_generate_batch`), on the same embedded model as iterserve, fp32, SDPA.
"""

from __future__ import annotations

import time

from offline_measure import Timed, make_result, rss_mib


def _load_hf(attn: str = "sdpa"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model_loader import resolve_model_dir

    model_dir = resolve_model_dir(None)  # the same directory as llm.llm_engine.model_dir
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn
    ).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    return model, tok, model_dir


def worker_hf_generate(wl: dict, cfg: dict) -> dict:
    import torch
    from transformers import GenerationConfig

    t0 = time.perf_counter()
    model, tok, model_dir = _load_hf()
    setup = time.perf_counter() - t0
    rss_loaded = rss_mib()
    pad = tok.eos_token_id  # prompts are left-padded by hand below, with an attention mask
    # ignore_eos: with eos_token_id None nothing stops on EOS and nothing suppresses it (a None
    # in the GenerationConfig passed to generate is filled from the model's, hence this).
    model.generation_config.eos_token_id = None

    def run_batch(prompts: list[list[int]], n_new: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        gc = GenerationConfig(
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=None,
        )
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
        new = out[:, width:]
        if new.shape[1] != n_new:
            raise RuntimeError(f"generate returned {new.shape[1]} new tokens, expected {n_new}")
        return new.tolist()

    run_batch([p[:32] for p in wl["prompts"][:2]], 4)  # warm-up

    B = cfg["batch_size"]
    prompts, lens = wl["prompts"], wl["output_lens"]
    tokens: list[list[int]] = []
    computed = 0
    with Timed() as tm:
        for s in range(0, len(prompts), B):
            n_new = max(lens[s : s + B])
            rows = run_batch(prompts[s : s + B], n_new)
            computed += n_new * len(rows)
            tokens.extend(r[:n] for r, n in zip(rows, lens[s : s + B]))
    return make_result(
        wl,
        tm.wall,
        tokens,
        setup_s=setup,
        rss_after_load_mib=rss_loaded,
        foreign_cores=tm.foreign,
        own_cores=tm.own,
        output_tokens_computed=computed,
        model_dir=str(model_dir),
    )


# --------------------------------------------------------------------------------------------
# Continuous batching
# --------------------------------------------------------------------------------------------


def _resolved_cb(mgr) -> dict:
    """What transformers actually built from our ContinuousBatchingConfig."""
    c = mgr.continuous_batching_config
    out = {
        k: getattr(c, k, None)
        for k in (
            "page_size",
            "num_blocks",
            "max_batch_tokens",
            "max_requests_per_batch",
            "max_blocks_per_request",
            "max_memory_percent",
            "use_async_batching",
            "use_cuda_graph",
            "allow_block_sharing",
            "scheduler_type",
        )
    }
    cache = getattr(getattr(mgr, "batch_processor", None), "cache", None)
    if cache is not None:
        out["cache_num_blocks"] = getattr(cache, "num_blocks", None)
        out["cache_max_batch_tokens"] = getattr(cache, "max_batch_tokens", None)
        tensor = getattr(cache, "cache_tensor", None)
        if tensor is not None:
            out["cache_tensor_mib"] = tensor.numel() * tensor.element_size() / 2**20
    out["attn_implementation"] = mgr.model.config._attn_implementation
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in out.items()}


def _cb_config(cfg: dict):
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(
        page_size=cfg["page_size"],
        num_blocks=cfg["num_blocks"],
        max_batch_tokens=cfg["max_batch_tokens"],
        max_requests_per_batch=cfg["max_requests_per_batch"],
        allow_block_sharing=cfg["allow_block_sharing"],
        auto_switch_to_flash=cfg["auto_switch_to_flash"],
        scheduler_type=cfg["scheduler_type"],
        default_compile_level=cfg["default_compile_level"],
    )


def _gen_config(n_new: int, pad: int):
    from transformers import GenerationConfig

    # eos_token_id=-1: EOS never matches, so it neither stops nor is suppressed
    return GenerationConfig(
        max_new_tokens=n_new, do_sample=False, eos_token_id=-1, pad_token_id=pad
    )


def _via_generate_batch(model, cfg: dict, pad: int, ps: list[list[int]], n_new: int):
    """``model.generate_batch`` on ``ps``, ``n_new`` tokens each: (tokens, timed section)."""
    with Timed() as tm:  # includes the manager's set-up and warm-up
        res = model.generate_batch(
            inputs=ps,
            generation_config=_gen_config(n_new, pad),
            continuous_batching_config=_cb_config(cfg),
        )
    out = list(res.values())
    if len(out) != len(ps) or any(r.error for r in out):
        errs = [r.error for r in out if r.error]
        raise RuntimeError(f"generate_batch returned {len(out)}/{len(ps)} results; {errs[:1]}")
    return [list(r.generated_tokens) for r in out], tm


def _collect(mgr, ids: list[str]) -> dict:
    """Wait for the manager's results of ``ids``: request id -> finished result."""
    done: dict = {}
    while len(done) < len(ids):
        r = mgr.get_result(timeout=1)
        if r is not None and r.is_finished():
            if r.error:
                raise RuntimeError(f"request {r.request_id} failed: {r.error}")
            done[r.request_id] = r
        elif r is None and not mgr.is_running():
            raise RuntimeError(
                f"continuous batching thread stopped with {len(done)}/{len(ids)} requests done"
            )
    return done


def _via_manager(model, cfg: dict, pad: int, ps: list[list[int]], ns: list[int], resolved: dict):
    """The manager ``generate_batch`` builds, one request per prompt with its own length:
    (tokens, timed section, manager set-up s); ``resolved`` gets :func:`_resolved_cb`."""
    import torch

    with torch.inference_mode():
        t = time.perf_counter()
        with model.continuous_batching_context_manager(
            generation_config=_gen_config(max(ns), pad),
            continuous_batching_config=_cb_config(cfg),
            block=True,
            timeout=30,
        ) as mgr:
            setup = time.perf_counter() - t
            resolved.update(_resolved_cb(mgr))
            with Timed() as tm:  # ends before the manager's stop/join
                ids = [
                    mgr.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
                    for i, (p, n) in enumerate(zip(ps, ns))
                ]
                done = _collect(mgr, ids)
    return [list(done[i].generated_tokens) for i in ids], tm, setup


def worker_hf_generate_batch(wl: dict, cfg: dict) -> dict:
    # Imported before the clock starts, as in worker_hf_generate: setup_s leaves out the import
    # of transformers; the helpers above import the same names again, from sys.modules.
    from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: F401

    t0 = time.perf_counter()
    model, tok, model_dir = _load_hf()
    rss_loaded = rss_mib()
    prompts, lens = wl["prompts"], wl["output_lens"]
    pad = tok.eos_token_id
    resolved: dict = {}
    warm = [p[:32] for p in prompts[:2]]
    if cfg["api"] == "generate_batch":
        _via_generate_batch(model, cfg, pad, warm, 4)
        setup = time.perf_counter() - t0
        n_new = max(lens)
        rows, tm = _via_generate_batch(model, cfg, pad, prompts, n_new)
        tokens = [r[:n] for r, n in zip(rows, lens)]
        extra = {
            "output_tokens_computed": n_new * len(prompts),
            "note": "wall includes generate_batch's manager set-up and warm-up",
        }
    else:
        _via_manager(model, cfg, pad, warm, [4, 4], resolved)
        load = time.perf_counter() - t0
        tokens, tm, mgr_setup = _via_manager(model, cfg, pad, prompts, lens, resolved)
        setup = load + mgr_setup
        extra = {"manager_setup_s": mgr_setup, "resolved_config": resolved}
    return make_result(
        wl,
        tm.wall,
        tokens,
        setup_s=setup,
        rss_after_load_mib=rss_loaded,
        foreign_cores=tm.foreign,
        own_cores=tm.own,
        model_dir=str(model_dir),
        **extra,
    )
