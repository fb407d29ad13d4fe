"""oneDNN-prepacked linear layers (engine.cpu.linear) against torch's own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu.linear import (
    BUCKETS_PER_OCTAVE,
    PackedLinear,
    prepack_linears,
    prepack_supported,
    row_bucket,
)

pytestmark = pytest.mark.skipif(
    not prepack_supported(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 96), (17, 96), (1, 5, 96), (2, 64, 96), (3, 33, 96)])
def test_packed_linear_equals_f_linear(shape, bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        got = PackedLinear(lin)(x)
        want = F.linear(x, lin.weight, lin.bias)
    assert got.shape == (*shape[:-1], 200)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_packed_linear_refuses_a_weight_it_cannot_pack(dtype):
    with pytest.raises(ValueError, match="fp32 CPU weight"):
        PackedLinear(nn.Linear(8, 8).to(dtype))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16, bias=False))
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as in SmolLM2

    def forward(self, ids):
        return self.head(self.proj(self.embed(ids)))


def test_prepack_linears_replaces_every_linear_and_keeps_outputs():
    torch.manual_seed(0)
    model = TinyLM().eval()
    ids = torch.tensor([[1, 7, 49, 3]])
    with torch.inference_mode():
        want = model(ids)
        assert prepack_linears(model) == 3
        got = model(ids)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert [m.tied for m in model.modules() if isinstance(m, PackedLinear)] == [False, False, True]
    # Only the tied embedding keeps a plain weight; biases move into the packed layers.
    assert [n for n, _ in model.named_parameters()] == ["embed.weight"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_row_buckets_cover_every_count_with_little_padding():
    buckets = [row_bucket(r) for r in range(1, 4097)]
    assert all(r <= b <= r * (1 + 1 / BUCKETS_PER_OCTAVE) for r, b in enumerate(buckets, 1))
    assert buckets == sorted(buckets)
    # 16 exact counts, then BUCKETS_PER_OCTAVE per octave: 16 + 8 * 8 up to 4096.
    assert len(set(buckets)) == 16 + BUCKETS_PER_OCTAVE * 8
    with pytest.raises(ValueError):
        row_bucket(0)


def test_packed_linear_runs_a_bounded_set_of_row_counts(monkeypatch):
    """Whatever row counts the steps bring, oneDNN sees only the buckets' (its caches are
    keyed by shape)."""
    lin = PackedLinear(nn.Linear(32, 48))
    seen: set[int] = set()
    product = lin._product

    def record(x):
        seen.add(x.shape[0])
        return product(x)

    monkeypatch.setattr(lin, "_product", record)
    with torch.inference_mode():
        for rows in range(1, 301):
            assert lin(torch.randn(rows, 32)).shape == (rows, 48)
    assert seen == {row_bucket(r) for r in range(1, 301)}
    assert len(seen) < 60
