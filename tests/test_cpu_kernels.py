"""The C kernels (engine.cpu.kernels) and the decoder layers built on them
(engine.cpu.kernel_layers) against PyTorch's ops and the fused PyTorch layers."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine.cpu import kernels as cpu_kernels
from engine.cpu.kernel_layers import KernelDecoderLayer, use_kernel_layers
from engine.cpu.kernels import load
from engine.layers.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from engine.layers.fused import fuse_layers
from tests.test_fused_layers import BLOCK, tiny_model

kernels = load()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler for engine.cpu.kernels")


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize(("rows", "parallel"), [(1, False), (5, False), (67, True)])
def test_rms_norm_with_and_without_the_residual_add(rows, parallel):
    x, delta, w = torch.randn(rows, 48), torch.randn(rows, 48), torch.randn(48)
    close(kernels.rms_norm(x, w, 1e-5, parallel=parallel), F.rms_norm(x, (48,), w, 1e-5))
    summed = x + delta
    close(
        kernels.rms_norm(x, w, 1e-6, delta=delta, parallel=parallel),
        F.rms_norm(summed, (48,), w, 1e-6),
    )
    close(x, summed)  # the residual stream was updated in place


@needs_kernels
@pytest.mark.parametrize(("rows", "parallel"), [(3, False), (67, True)])
def test_silu_mul(rows, parallel):
    """20 columns: 16 in the kernel's vector loop (its own exp), 4 after it; gates up to
    +-120, past the exp's clamp at -87."""
    gu = torch.randn(rows, 40)
    gu[:, :20] *= 30
    close(kernels.silu_mul(gu, parallel=parallel), F.silu(gu[:, :20]) * gu[:, 20:])


@needs_kernels
@pytest.mark.parametrize(("rows", "parallel"), [(5, False), (67, True)])
def test_rope_on_a_strided_view_matches_rotate_half(rows, parallel):
    qkv = torch.randn(rows, 3 * 16 + 8)
    q = qkv[:, :48].view(rows, 3, 16)
    cos, sin = torch.randn(rows, 16), torch.randn(rows, 16)
    half = torch.cat([-q[..., 8:], q[..., :8]], dim=-1)
    expected = q * cos[:, None] + half * sin[:, None]
    tail = qkv[:, 48:].clone()
    kernels.rope_(q, cos, sin, parallel=parallel)
    close(q, expected)
    assert torch.equal(qkv[:, 48:], tail)  # the rest of each row is untouched


@needs_kernels
@pytest.mark.parametrize(("rows", "parallel"), [(3, False), (67, True)])
def test_cache_write_puts_each_row_at_its_slot(rows, parallel):
    k, v = torch.randn(rows, 24)[:, :8], torch.randn(rows, 8)
    kc, vc = torch.zeros(2 * rows, 8), torch.zeros(2 * rows, 8)
    slots = torch.randperm(2 * rows)[:rows]
    kernels.cache_write(k, v, slots, kc, vc, parallel=parallel)
    close(kc[slots], k)
    close(vc[slots], v)
    assert kc.abs().sum(1).nonzero().flatten().tolist() == sorted(slots.tolist())


@needs_kernels
@pytest.mark.parametrize("lens", [[14, 5, 1], [700, 333, 1]])  # the second: 1034 tokens, on
def test_decode_attention_matches_dense_attention_over_paged_blocks(lens):  # two threads
    torch.manual_seed(0)
    heads, kv_heads, d, bs = 6, 2, 8, 4
    need = [-(-n // bs) for n in lens]
    kc, vc = (torch.randn(sum(need) + 2, bs, kv_heads, d) for _ in range(2))
    perm = torch.randperm(len(kc)).int()
    tables = torch.zeros(3, max(need), dtype=torch.int32)
    for i, off in enumerate([0, need[0], need[0] + need[1]]):
        tables[i, : need[i]] = perm[off : off + need[i]]
    lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(3, heads, d)
    out = torch.empty_like(q)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        kernels.decode_attention(q, kc, vc, tables, lens, 0.3, out)
    finally:
        torch.set_num_threads(saved)
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        slots = tables[i, pos // bs].long() * bs + pos % bs
        k = kc.view(-1, kv_heads, d)[slots].transpose(0, 1)  # [KVH, n, d]
        v = vc.view(-1, kv_heads, d)[slots].transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[i][:, None], k, v, scale=0.3, enable_gqa=True)
        close(out[i], ref[:, 0])


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads,kv_heads,d", [(6, 2, 64), (4, 2, 128), (4, 4, 64), (8, 2, 64)])
def test_prefill_attention_matches_causal_attention_over_paged_blocks(threads, heads, kv_heads, d):
    """Three chunks in one step: a first chunk longer than one work unit (16 tokens), a later
    chunk after 21 cached tokens, and a one-token chunk; scattered blocks. The head shapes
    give a work unit 16 to 64 query rows (1 to 4 lanes of 16) and 1 or 2 column tiles."""
    torch.manual_seed(0)
    bs = 4
    chunks, before = [37, 9, 1], [0, 21, 3]  # query tokens, tokens cached before the chunk
    lens = [c + b for c, b in zip(chunks, before)]
    need = [-(-n // bs) for n in lens]
    perm = torch.randperm(sum(need) + 3).int()
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    for i, off in enumerate([0, need[0], need[0] + need[1]]):
        tables[i, : need[i]] = perm[off : off + need[i]]
    kc, vc = (torch.randn(len(perm), bs, kv_heads, d) for _ in range(2))
    qsl = torch.tensor([0, 37, 46, 47], dtype=torch.int32)
    q = torch.randn(47, heads, d)
    out = torch.zeros_like(q)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernels.prefill_attention(
            q, kc, vc, tables, qsl, torch.tensor(lens, dtype=torch.int32), 0, 0.3, out
        )
    finally:
        torch.set_num_threads(saved)
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        slots = tables[i, pos // bs].long() * bs + pos % bs
        k = kc.view(-1, kv_heads, d)[slots].transpose(0, 1)  # [KVH, n, d]
        v = vc.view(-1, kv_heads, d)[slots].transpose(0, 1)
        rows = slice(qsl[i].item(), qsl[i + 1].item())
        mask = pos[None] <= torch.arange(before[i], n)[:, None]  # [chunk, n]
        ref = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k, v, attn_mask=mask, scale=0.3, enable_gqa=True
        )
        close(out[rows], ref.transpose(0, 1))


@needs_kernels
def test_prefill_attention_refuses_a_head_dim_it_does_not_tile():
    kc, q = torch.zeros(2, 4, 1, 32), torch.zeros(1, 2, 32)
    one, table = torch.ones(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of 64"):
        kernels.prefill_attention(
            q,
            kc,
            kc,
            table,
            torch.tensor([0, 1], dtype=torch.int32),
            one,
            0,
            1.0,
            torch.zeros_like(q),
        )


def step_metadata(caches, decodes, prefills, tables) -> AttentionMetadata:
    """A step of single-token ``decodes`` (context lengths after it, longest first) and
    first-chunk ``prefills`` (lengths); ``tables`` holds every sequence's blocks in order."""
    qsl, slots, ctx = [0], [], []
    for i, n in enumerate(decodes):
        slots.append(tables[i][(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK)
        qsl.append(qsl[-1] + 1)
        ctx.append(n)
    for j, n in enumerate(prefills):
        table = tables[len(decodes) + j]
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
        qsl.append(qsl[-1] + n)
        ctx.append(n)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    md = AttentionMetadata(
        kv_caches=caches,
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(prefills, default=1),
        max_context_len=max(ctx),
        num_decodes=len(decodes),
        prefills=[
            PrefillChunk(qsl[len(decodes) + j], qsl[len(decodes) + j + 1], None, None)
            for j in range(len(prefills))
        ],
    )
    if decodes:
        p = torch.arange(decodes[0])
        md.decode_groups.append(
            DecodeGroup(
                0,
                len(decodes),
                slots=block_tables[: len(decodes), p // BLOCK].long() * BLOCK + p % BLOCK,
                mask=(p[None] < torch.tensor(decodes)[:, None]).view(-1, 1, 1, len(p)),
            )
        )
    return md


def run_steps(model, steps) -> list[torch.Tensor]:
    """Logits of each ``(ids, positions, metadata builder)`` step, one shared KV cache."""
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (24, BLOCK, cfg.num_key_value_heads, d)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]
    out = []
    with torch.inference_mode():
        for ids, pos, md in steps:
            out.append(
                model(
                    input_ids=ids[None],
                    position_ids=pos[None],
                    use_cache=False,
                    attn_metadata=md(caches),
                ).logits[0]
            )
    return out


@needs_kernels
@pytest.mark.parametrize(
    ("arch", "c_len", "head_dim"),
    [
        ("llama", 6, None),
        ("qwen2", 6, None),
        ("qwen3", 6, None),
        ("llama", 40, None),  # 42 rows: the norms and SiLU on all threads
        ("llama", 40, 64),  # prefills in the prefill_attention kernel (head_dim 8: SDPA)
    ],
)
def test_kernel_layers_equal_the_fused_pytorch_layers_in_a_mixed_step(arch, c_len, head_dim):
    fused = tiny_model(arch, head_dim)
    fuse_layers(fused)
    kernel = copy.deepcopy(fused)
    assert use_kernel_layers(kernel, kernels) == 2
    assert isinstance(kernel.model.layers[1], KernelDecoderLayer)
    assert kernel.model.layers[1].prefill_kernel == (head_dim == 64)
    torch.manual_seed(1)
    a, b, c = (torch.randint(0, 64, (n,)) for n in (7, 5, c_len))
    # scattered blocks; A's and B's second block partly full
    tables = [[5, 1], [0, 3], [2, 4, *range(8, 8 + -(-c_len // BLOCK) - 2)]]
    steps = [
        (
            torch.cat([a, b]),
            torch.cat([torch.arange(7), torch.arange(5)]),
            lambda caches: step_metadata(caches, [], [7, 5], tables[:2]),
        ),
        # A and B decode (contexts 8 and 6) while C's prompt is prefilled in the same step
        (
            torch.cat([torch.tensor([3, 9]), c]),
            torch.cat([torch.tensor([7, 5]), torch.arange(c_len)]),
            lambda caches: step_metadata(caches, [8, 6], [c_len], tables),
        ),
    ]
    for got, want in zip(run_steps(kernel, steps), run_steps(fused, steps)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@needs_kernels
def test_an_unfused_layer_is_refused():
    with pytest.raises(ValueError, match="fused"):
        KernelDecoderLayer(tiny_model("llama").model.layers[0], kernels)


def test_without_a_compiler_the_engine_falls_back_to_pytorch_ops(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc on it
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path / "cache"))  # nothing built there
    assert load.__wrapped__() is None
    assert "CPU kernels unavailable" in caplog.text


@needs_kernels
def test_the_kernels_can_be_turned_off(monkeypatch):
    assert load.__wrapped__() is not None  # a compiler is here: they would load
    monkeypatch.setenv("ITERSERVE_CPU_KERNELS", "0")
    assert load.__wrapped__() is None


@needs_kernels
def test_without_openmp_the_kernels_build_and_run_on_one_thread(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_kernels, "OPENMP_FLAG", "-fno-such-option")
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    single = load.__wrapped__()
    assert single is not None and not single.parallel
    assert "without OpenMP" in caplog.text
    q, kc = torch.randn(3, 2, 64), torch.randn(1, 4, 1, 64)
    out, want = torch.zeros_like(q), torch.zeros_like(q)
    args = (
        kc,
        kc,
        torch.zeros(1, 1, dtype=torch.int32),
        torch.tensor([0, 3], dtype=torch.int32),
        torch.tensor([3], dtype=torch.int32),
        0,
        0.5,
    )
    single.prefill_attention(q, *args, out)
    kernels.prefill_attention(q, *args, want)
    close(out, want)


def test_loading_the_kernels_leaves_the_process_floating_point_mode_alone():
    # A library linked with -ffast-math turns on flush-to-zero in the thread that loads it:
    # every subnormal result of the process (its own Python floats included) becomes 0.
    code = (
        "from engine.cpu import kernels as cpu_kernels\n"
        "assert cpu_kernels.load() is not None\n"
        "print(2.2250738585072014e-308 / 2 > 0)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "True", out.stderr
