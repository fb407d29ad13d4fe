"""transformers' embeddings, the reference of every embedding test: a causal LM's final
hidden states (its base model's ``last_hidden_state``, after the last norm), pooled and
L2-normalized in fp32 as the engine pools them (:class:`engine.PoolingParams`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

COSINE = 0.99999
"""The least cosine an engine vector may have with its reference (fp32)."""
COMPONENT = 1e-5
"""The most any component of an engine vector may differ from its reference's (fp32)."""


def final_hidden(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The final hidden states ``[len(ids), hidden]`` (fp32) of prompt ``ids`` under
    ``model``, a transformers ``*ForCausalLM``: its base model's ``last_hidden_state``."""
    with torch.inference_mode():
        return model.model(torch.tensor([ids])).last_hidden_state[0].float()


def pool(
    hidden: torch.Tensor, pooling: str = "last", dimensions: int | None = None
) -> torch.Tensor:
    """``hidden`` (:func:`final_hidden`) as the engine pools it: ``last`` or ``mean``
    pooling, cut to ``dimensions``, then L2-normalized; ``[dimensions or hidden]``."""
    vector = hidden[-1] if pooling == "last" else hidden.mean(0)
    return F.normalize(vector[:dimensions] if dimensions else vector, dim=0)


def compare(got: list[float], want: torch.Tensor) -> tuple[float, float]:
    """``(cosine, largest component difference)`` of an engine vector and its reference;
    asserts they are within :data:`COSINE` and :data:`COMPONENT`."""
    v = torch.tensor(got, dtype=torch.float32)
    assert v.shape == want.shape, (v.shape, want.shape)
    cosine = float(
        torch.dot(v.double(), want.double()) / (v.double().norm() * want.double().norm())
    )
    err = float((v - want).abs().max())
    assert cosine >= COSINE and err <= COMPONENT, (cosine, err)
    return cosine, err
