"""oneDNN-prepacked linear layers (engine.cpu_linear) against torch's own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu_linear import PackedLinear, prepack_linears, prepack_supported

pytestmark = pytest.mark.skipif(
    not prepack_supported(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 96), (17, 96), (1, 5, 96), (2, 64, 96)])
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
