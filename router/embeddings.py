"""``POST /v1/embeddings``: its inputs as prompts, its pooling parameters, and its response
body from each input's one step item.

Each input is one engine request (a prefill-only request: :class:`PoolingParams`),
admitted and routed on its own as each prompt of a completion is; its one step item
carries its vector (:attr:`router.contract.StepItem.embedding`). Pure functions of a
validated request (:class:`router.schemas.EmbeddingRequest`) and the replicas'
:class:`router.contract.ModelInfo`, but :func:`collect`, which reads the calls.
"""

from __future__ import annotations

import base64
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.core.params import PoolingParams
from router.contract import ModelInfo
from router.errors import ApiError
from router.responses import PromptCall, StartBy, merged
from router.schemas import EmbeddingRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(slots=True)
class EmbeddingReply:
    """One embeddings request's calls, one per input, in input order."""

    rid: str
    model: str
    calls: list[PromptCall]
    encoding_format: str
    start_by: StartBy | None = None
    """The deadline of every input's item (:func:`router.responses.merged`); None: none."""


def check(req: EmbeddingRequest, info: ModelInfo, max_inputs: int) -> None:
    """Whether the replicas can answer ``req``.

    Raises:
        ApiError: 400 for more inputs than ``max_inputs``, for replicas that compute no
            embeddings, or for ``dimensions`` that is neither the full size nor one of
            the engine's ``embedding_dimensions``.
    """
    if len(req.input) > max_inputs:
        raise ApiError(
            400,
            f"input: {len(req.input)} inputs are over the server's cap of {max_inputs} "
            "(max_embedding_inputs)",
            param="input",
            code="invalid_value",
        )
    if not info.embedding_size:
        raise ApiError(
            400, "this model's replicas compute no embeddings", param="model", code="invalid_value"
        )
    d = req.dimensions
    if d is None or d == info.embedding_size or d in info.embedding_dimensions:
        return
    if info.embedding_dimensions:
        sizes = ", ".join(map(str, sorted(info.embedding_dimensions)))
        why = f"they can be cut to {sizes} only"
    else:
        why = (
            "this model does not support `dimensions` (the server's "
            "engine.embedding_dimensions lists the sizes of a Matryoshka-trained model)"
        )
    raise ApiError(
        400,
        f"dimensions: {d}: this model's embeddings have {info.embedding_size} dimensions; " + why,
        param="dimensions",
        code="invalid_value",
    )


def prompts(
    req: EmbeddingRequest, tokenizer: PreTrainedTokenizerBase
) -> list[tuple[list[int], str]]:
    """Each input's token ids and text: a text is tokenized as the model's tokenizer does
    by default (its special tokens added, as ``tokenizer(text)``), token ids are taken as
    they are.

    Raises:
        ApiError: 400 for an input that tokenizes to nothing.
    """
    out = []
    for item in req.input:
        if isinstance(item, str):
            out.append((tokenizer.encode(item), item))
        else:
            out.append((list(item), tokenizer.decode(item)))
        if not out[-1][0]:
            raise ApiError(400, "input is empty", param="input", code="invalid_value")
    return out


def pooling_params(req: EmbeddingRequest) -> PoolingParams:
    """The engine request of each input (the same for all of them)."""
    return PoolingParams(dimensions=req.dimensions)


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """One vector as the response carries it: the numbers (``float``), or their
    little-endian float32 bytes in base64 (``base64``; the vectors are fp32, so nothing
    is rounded)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


async def collect(reply: EmbeddingReply) -> dict[str, Any]:
    """The response body: ``{"id", "object": "list", "created", "model", "data": [{"object":
    "embedding", "index", "embedding"}, ...], "usage": {"prompt_tokens",
    "total_tokens"}}``, ``data`` in input order.

    Raises:
        QueueTimeout: an input had not started at ``reply.start_by``.
        ReplicaLost, ApiError: as the calls' ``items()`` raise them; ApiError 503
            ``request_failed`` too for an input that finished without a vector.
    """
    vectors: list[list[float] | None] = [None] * len(reply.calls)
    async for p, item in merged(reply.calls, reply.start_by):
        if item.embedding is not None:
            vectors[p] = item.embedding
    data = []
    for index, vector in enumerate(vectors):
        if vector is None:
            raise ApiError(503, f"input {index} ended without a vector", code="request_failed")
        data.append(
            {
                "object": "embedding",
                "index": index,
                "embedding": encode(vector, reply.encoding_format),
            }
        )
    tokens = sum(c.dispatch.prompt_tokens for c in reply.calls)
    return {
        "id": reply.rid,
        "object": "list",
        "created": int(time.time()),
        "model": reply.model,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
