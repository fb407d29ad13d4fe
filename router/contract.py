"""The contract between the ingress and its model replicas: what a call sends, what a
replica streams back, and the protocols that every way of reaching a replica implements.

A request's path: the ingress (:class:`router.ingress.Ingress`) asks its
:class:`Replicas` for a :class:`ReplicaCall` per prompt, with the prompt's token ids, its
:class:`engine.core.params.SamplingParams` (built and checked once by
:func:`router.openai_format.sampling_params`; the replica's engine takes them as they are),
or an embedding's :class:`engine.core.params.PoolingParams`, and its
:class:`RequestShape`. The replica answers the call with one :data:`FirstItem`: an
:class:`Accepted` once its engine queued the request, or a :class:`Refused` (and nothing
more) when the engine can never run it. Then one :class:`StepItem` per engine step that
produced tokens, the last with ``finished`` (and ``error`` when the request alone failed
inside the engine); a :class:`Lost` instead when the engine serving the request failed.
An embedding request has one step item, ``finished``, with its ``embedding``.

Both sides import this module: the ingress (:mod:`router.ingress`, :mod:`router.dispatch`,
:mod:`router.local`) and the replicas (:mod:`deploy.engine_replica`, :mod:`deploy.replica`).
It sits in ``router`` because ``deploy`` is the layer above: the replicas may import the
router's modules, the ingress never imports ``deploy``. Ray Serve pickles the call's
arguments and the items between the replica's and the ingress's processes: they are data
classes of plain values, :class:`engine.core.params.SamplingParams` (or ``PoolingParams``)
and :class:`policies.LoadSnapshot`, so both ends need only this module, the torch-free
:mod:`engine.core.params` and ``policies``.

:class:`Replicas` is implemented by :class:`router.dispatch.RayReplicas` (a Ray Serve
deployment's replicas) and :class:`router.local.LocalReplicas` (one engine in the
ingress's own process: ``iterserve serve`` on one machine, and each replica of
``iterserve batch run``, whose lines go through :meth:`router.ingress.Ingress.answer`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from engine.core.params import LoRARequest, PoolingParams, SamplingParams
from policies import LoadSnapshot
from policies.limits import RequestLimits
from router.errors import ApiError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from router.metrics import RequestRecord


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What routing and admission need to know of a request (sent as the call's ``shape``
    keyword: Ray Serve's request router reads it there)."""

    prompt_tokens: int
    traffic_class: str
    priority: int
    prefix_hashes: tuple[int, ...] = ()
    """:func:`router.prefix.prefix_hashes` of the prompt; empty: no prefix affinity."""
    lora: LoRARequest | None = None
    """The LoRA adapter the request runs with (None: the base model): a replica that has
    not loaded it yet reads it from its path."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the ingress needs of the replicas once: the tokenizer and the limits."""

    tokenizer: PreTrainedTokenizerBase
    limits: RequestLimits
    """The replicas' limits, the engine's own (the replica re-checks with them)."""
    weight_format: str = ""
    """How the replicas hold the model's weights (``"gguf Q4_1+Q8_0"``, ``"float32"``);
    empty where unknown."""
    weight_bytes: int = 0
    """Bytes the weights occupy in one replica (0 where unknown)."""
    embedding_size: int = 0
    """The length of an embedding's full vector (the model's hidden size); 0: the
    replicas compute no embeddings."""
    embedding_pooling: str = "last"
    """How an embedding pools the prompt's final hidden states (``last`` or ``mean``; the
    engine's ``embedding_pooling``)."""
    embedding_dimensions: tuple[int, ...] = ()
    """The sizes an embedding may be cut to besides ``embedding_size`` (the engine's
    ``embedding_dimensions``)."""


@dataclass(frozen=True, slots=True)
class Accepted:
    """A replica's first item: its engine queued the request."""

    prompt_tokens: int
    """The prompt's length in tokens, as the engine counts it."""
    replica: str
    """The replica's id (Ray Serve's unique id of the replica, or the local one's)."""
    load: LoadSnapshot | None = None
    """The engine's load when it changed since the replica last sent one (see
    :attr:`StepItem.load`)."""


@dataclass(frozen=True, slots=True)
class Refused:
    """A replica's first and only item: its engine can never run the request (too long
    for its context or KV cache, a sampling parameter it rejects)."""

    message: str
    """What is wrong, with the numbers."""
    code: str
    """``context_length_exceeded`` or ``invalid_value``."""
    param: str | None = None
    """The request field at fault, if one is."""
    status: int = 400

    def error(self) -> ApiError:
        """The API's answer to the refusal."""
        return ApiError(self.status, self.message, param=self.param, code=self.code)


@dataclass(frozen=True, slots=True)
class SequenceDelta:
    """One sequence's new output in one step."""

    index: int
    """The sequence's index among the request's ``n``."""
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    """One ``{token id: log-probability}`` per new token, when the request asked for them."""
    finish_reason: str | None
    """``stop`` or ``length`` in the step that ended the sequence, else None."""
    stop_reason: str | int | None
    """The stop string or token id that ended it, if one did."""


@dataclass(frozen=True, slots=True)
class StepItem:
    """One engine step's output for one request: the sequences that produced text, tokens
    or their end in that step."""

    outputs: list[SequenceDelta]
    finished: bool
    """Every sequence of the request has ended: this is its last item."""
    queue_s: float | None = None
    """In the first item only: seconds from the engine's arrival to the first step that
    scheduled the request."""
    cached_tokens: int | None = None
    """In the first item only: prompt tokens whose KV the prefix cache supplied."""
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """The prompt's log-probabilities (one entry per prompt token, the first None), in
    the item that has them when the request asked for them."""
    load: LoadSnapshot | None = None
    """The engine's load snapshot when it changed since the replica last sent one
    (``AsyncLLMEngine.load_update``), so that an ingress in another process sees the
    replica's load step by step; always None for an ingress in the engine's process,
    which reads the engine's snapshot itself."""
    error: str | None = None
    """The request failed inside the engine (an exception in its step; the engine went
    on): what was raised. Set on its last item, ``finished``, with no outputs; the
    ingress answers 503 ``request_failed`` (:func:`router.calls.request_failed`)."""
    embedding: list[float] | None = None
    """An embedding request's vector, on its one item (``finished``)."""


@dataclass(frozen=True, slots=True)
class Lost:
    """In place of a step item: the engine serving the request failed."""

    message: str


FirstItem = Accepted | Refused
"""A replica's answer to a call."""
StreamItem = StepItem | Lost
"""What follows an :class:`Accepted` on the request's stream."""


class ReplicaCall(Protocol):
    """One request's (one prompt's) call to a replica.

    ``prompt_tokens`` and ``replica`` are known once :meth:`start` returned,
    ``cached_tokens`` from the first step item on.
    """

    prompt_tokens: int
    cached_tokens: int
    replica: str

    async def start(self) -> None:
        """Send the request; return once a replica accepted it.

        Raises:
            ApiError: the replica refused it (:meth:`Refused.error`), or none could take
                it (503).
        """
        ...

    def items(self) -> AsyncIterator[StepItem]:
        """The request's step items, the last one ``finished``.

        Raises:
            router.calls.ReplicaLost: the replica failed and the request could not move to
                another (:mod:`router.dispatch`).
            ApiError: a request re-sent to another replica was refused.
        """
        ...

    def cancel(self) -> None:
        """Abort the request (the engine frees its KV blocks before its next step); a
        call that ended already is left as it is."""
        ...


class Replicas(Protocol):
    """The model's replicas as the ingress reaches them: one protocol for every path (the
    engine in the ingress's process, a Ray Serve deployment's replicas, and each replica
    of a batch), however many replicas stand behind it."""

    async def info(self) -> ModelInfo:
        """The replicas' tokenizer and limits.

        Raises:
            ApiError: 503 when no replica answers.
        """
        ...

    def call(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        shape: RequestShape,
        record: RequestRecord | None = None,
    ) -> ReplicaCall:
        """The call of one prompt; ``params`` as :func:`router.openai_format.sampling_params`
        built them (``DELTA`` outputs), or an embedding's; ``record`` is told of every item
        and of how the call ended.

        Raises:
            ApiError: 503 when no replica can be called.
        """
        ...

    def loads(self, shape: RequestShape) -> list[tuple[LoadSnapshot, int]]:
        """Each replica's snapshot and the tokens of ``shape``'s prompt it likely holds
        in its prefix cache (admission's input)."""
        ...

    def snapshots(self) -> dict[str, LoadSnapshot]:
        """Each live replica's latest snapshot by its id."""
        ...

    def count(self) -> int:
        """Replicas running now."""
        ...

    def stats(self) -> dict[str, dict[str, Any]]:
        """Each replica's routing stats by its id: its snapshot's fields and, under
        ``"metrics"``, its step counts (``/metrics`` renders them)."""
        ...

    async def load_lora(self, lora: LoRARequest) -> None:
        """Load adapter ``lora`` on a replica now, which checks it; the others load it on
        its first request there (each call carries it: :attr:`RequestShape.lora`).

        Raises:
            ApiError: 400 when the adapter cannot be served (the message says why); 503
                when no replica answers.
        """
        ...

    async def unload_lora(self, name: str) -> None:
        """Have every running replica forget adapter ``name`` (requests running with it
        finish with it)."""
        ...


class StepEvents(Protocol):
    """Where the ingress records each request's arrival, admission or refusal, and reads
    the replica's recent steps for ``GET /steps`` (:class:`engine.core.step_log.StepRecorder`;
    its module gives the records' format). Times are ``time.monotonic`` seconds."""

    def arrival(
        self,
        request_id: str,
        t: float,
        traffic_class: str,
        priority: int,
        prompt_tokens: int,
        max_tokens: int | None,
    ) -> None: ...

    def admitted(self, request_id: str, t: float, held_s: float) -> None: ...

    def refused(self, request_id: str, t: float, reason: str) -> None: ...

    def recent(self, since: float | None = None) -> list[dict[str, Any]]:
        """The header record, then the kept records at or after ``since``."""
        ...
