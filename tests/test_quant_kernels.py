"""The packed-weight kernels against gguf-py's de-quantization, at every instruction-set
level this CPU runs: random blocks are valid blocks of every format (the fp16 scales set to
finite values), so each K-quant is checked without a file that holds it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.quant import kernels as quant_kernels
from engine.quant.formats import FORMATS, PackedTensor
from engine.quant.gguf_weights import unpermute_rows
from engine.quant.linear import QuantEmbedding, QuantLinear, concat_linears
from engine.quant.quantize import quantize_int4, quantize_int8

KERNELS = quant_kernels.load()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler")
pytestmark = needs_kernels

GGUF_FORMATS = [n for n in FORMATS if n != "I8R"]
# Offsets of each format's fp16 fields within a block (ggml-common.h).
HALF_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}
# The row counts of each path: one row (decode), register tiles (2-19), panels (20 and up).
ROWS = (1, 2, 5, 8, 13, 20, 47)


def levels() -> list[int]:
    best = KERNELS._lib.q_cpu_level() if KERNELS else 0
    return [lv for lv in (0, 3, 4) if lv <= best]


@pytest.fixture(params=levels(), ids=lambda lv: quant_kernels.LEVEL_NAMES[lv])
def level(request):
    before = KERNELS.level
    KERNELS.set_level(request.param)
    yield request.param
    KERNELS.set_level(before)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def random_rows(name: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """``rows`` rows of random ``name`` blocks with finite fp16 scales of either sign."""
    rng = np.random.default_rng(seed)
    fmt = FORMATS[name]
    nb = k // fmt.block_weights
    raw = rng.integers(0, 256, size=(rows, nb, fmt.block_bytes), dtype=np.uint8)
    for off in HALF_FIELDS[name]:
        h = rng.uniform(1e-3, 0.1, size=(rows, nb)) * rng.choice([-1, 1], size=(rows, nb))
        raw[:, :, off : off + 2] = h.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, nb * fmt.block_bytes)


def packed(name: str, rows: int, k: int, seed: int = 0) -> tuple[PackedTensor, torch.Tensor]:
    """Random packed rows and gguf-py's de-quantization of them (fp32 ``[rows, k]``)."""
    raw = random_rows(name, rows, k, seed)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(rows, k)
    return PackedTensor(FORMATS[name], torch.from_numpy(raw), k), torch.from_numpy(ref.copy())


@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_expansion_equals_gguf_py_bit_for_bit(name, level):
    w, ref = packed(name, 37, 512)
    assert torch.equal(KERNELS.expand(w), ref)
    ids = torch.tensor([[5, 0], [36, 5]])
    assert torch.equal(KERNELS.expand(w, ids), ref[ids])


@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_products_equal_the_fp32_product(name, level):
    w, ref = packed(name, 45, 768, seed=1)
    bias = torch.randn(45)
    for m in ROWS:
        x = torch.randn(m, 768)
        want = (x.double() @ ref.double().T + bias.double()).float()
        out = torch.empty(m, 45)
        KERNELS.matmul(w, x, out, bias)
        # Only the order of the sums differs from an fp32 product.
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_a_product_writes_only_its_columns_of_a_wider_output(level):
    w, ref = packed("Q4_1", 24, 64)
    for m in (1, 6, 25):
        x = torch.randn(m, 64)
        out = torch.full((m, 40), 7.0)
        KERNELS.matmul(w, x, out[:, 10:34])
        want = x @ ref.T
        torch.testing.assert_close(
            out[:, 10:34], want, rtol=1e-5, atol=1e-5 * float(want.abs().max())
        )
        assert (out[:, :10] == 7).all() and (out[:, 34:] == 7).all()


def test_an_unknown_format_is_refused():
    bad = PackedTensor(FORMATS["Q4_1"], torch.zeros(4, 20, dtype=torch.uint8), 32)
    object.__setattr__(bad, "fmt", FORMATS["Q4_1"].__class__("X", 99, 32, 20))
    with pytest.raises(quant_kernels.KernelError):
        KERNELS.matmul(bad, torch.zeros(1, 32), torch.empty(1, 4))


def test_packed_tensors_check_their_shape():
    with pytest.raises(ValueError, match="multiples of 32"):
        FORMATS["Q8_0"].row_bytes(40)
    with pytest.raises(ValueError, match="uint8"):
        PackedTensor(FORMATS["Q8_0"], torch.zeros(2, 33, dtype=torch.uint8), 32)


def test_int8_and_int4_quantization_round_trip_within_their_steps():
    w = torch.randn(16, 256) * 0.05
    w[3] = 0  # an all-zero row and group: scale 0 must not divide
    q8 = KERNELS.expand(quantize_int8(w))
    step8 = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((q8 - w).abs() <= step8 / 2 + 1e-7).all()
    q4 = KERNELS.expand(quantize_int4(w))
    groups = w.view(16, 8, 32)
    step4 = (groups.amax(dim=2) - groups.amin(dim=2)) / 15
    err = (q4 - w).view(16, 8, 32).abs().amax(dim=2)
    # Half a step, plus the fp16 rounding of the scale and minimum.
    assert (err <= step4 * 0.51 + 2e-4).all()
    assert (q8[3] == 0).all() and (q4[3] == 0).all()


def test_quant_linear_joins_packed_and_float_parts():
    a, ra = packed("Q4_K", 8, 256)
    b, rb = packed("Q6_K", 4, 256, seed=2)
    c = torch.nn.Linear(256, 5, bias=False)
    qa, qb = QuantLinear([a], 256, KERNELS), QuantLinear([b], 256, KERNELS)
    joined = concat_linears([qa, qb, c], KERNELS)
    assert joined.formats() == ["Q4_K", "Q6_K", "F32"] and joined.out_features == 17
    x = torch.randn(3, 2, 256)
    want = F.linear(x, torch.cat([ra, rb, c.weight.detach()]))
    # Only the order of the sums differs: within fp32's rounding of the largest output.
    torch.testing.assert_close(joined(x), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # Adjacent parts of one format become one part (one kernel call).
    same = concat_linears([qa, QuantLinear([packed("Q4_K", 3, 256, 4)[0]], 256, KERNELS)], KERNELS)
    assert same.formats() == ["Q4_K"] and same.out_features == 11


def test_quant_embedding_looks_up_rows_and_refuses_ids_outside_the_table():
    w, ref = packed("Q8_0", 10, 64)
    emb = QuantEmbedding(w, KERNELS)
    ids = torch.tensor([[1, 9], [0, 1]])
    assert torch.equal(emb(ids), ref[ids])
    for bad in (10, -1):
        with pytest.raises(IndexError):
            emb(torch.tensor([bad]))


def test_unpermute_rows_undoes_llama_cpps_permutation():
    # llama.cpp's convert_hf_to_gguf.py permutes q/k rows per head: [2, half] -> [half, 2].
    heads, head_dim = 3, 8
    w = np.arange(heads * head_dim * 4).reshape(heads * head_dim, 4)
    permuted = w.reshape(heads, 2, head_dim // 2, 4).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(unpermute_rows(permuted, heads), w)
