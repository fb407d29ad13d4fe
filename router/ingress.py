"""The ingress: OpenAI-compatible REST routes, validation, admission, SSE streaming.

One request's path: the body is read (413 past the size limit) and validated (400 naming
the field), the model checked (404), the caller resolved from its API key
(:mod:`router.tenants`), the prompt tokenized (chat template for chat), admission asked
(:mod:`router.admission`; 429 with Retry-After), and the request sent to a replica. The
replica's step items become OpenAI chunks (SSE ending with ``data: [DONE]``) or one
response (:mod:`router.openai_format`). ``POST /v1/embeddings`` takes the same path, each
input a prefill-only request whose one item carries its vector (:mod:`router.embeddings`).

:class:`Ingress` holds no Ray: its replicas are a :class:`router.contract.Replicas`
(:class:`router.dispatch.RayReplicas` for the Ray Serve deployment, :mod:`router.api`;
:class:`router.local.LocalReplicas` for one replica in the server's own process,
:mod:`deploy.local_server`, and for each replica of a batch, :mod:`deploy.batch_engine`,
which sends each batch line through :meth:`Ingress.answer`: the same validation,
admission, dispatch and response as ``POST /v1/...``).

If a replica dies, its requests move to another (:mod:`router.dispatch`); one that
cannot move ends its stream with an error event. A client that disconnects cancels the
replica call, which aborts the engine request before its next step and frees its KV
blocks; streamed or not, and on both paths (the ingress watches the connection itself,
:meth:`Ingress._collect`). A client that
leaves while it sends its body is logged at INFO and answered 499 (:data:`CLIENT_GONE`).

No request of a rejectable class waits without bound (:func:`queue_bound`): one that has
not started (no first token) within its class's bound after its arrival is refused,
whether admission held it or a replica queued it: 429 with Retry-After while nothing was
sent, an error event then ``data: [DONE]`` in a stream already open. Its calls are
cancelled, which frees its place and its KV blocks. ``iterserve:admission_rejections``
counts it with reason ``queue_timeout``. A stream (of any class) sends an SSE comment
after every ``stream_keepalive_s`` of silence, so that a proxy's idle timeout does not
cut a request that is only waiting.
"""

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import asdict
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engine.core.params import LoRARequest, PoolingParams, SamplingParams
from policies import TrafficClass, make_classes, policy_from_spec
from router import embeddings as emb
from router import openai_format as fmt
from router import responses, tools
from router.admission import AdmissionRejected, IngressAdmission
from router.calls import RETRY_AFTER_S, ReplicaLost
from router.contract import ModelInfo, ReplicaCall, Replicas, RequestShape, StepEvents
from router.cors import ConfiguredCORS
from router.errors import ApiError
from router.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from router.metrics import IngressMetrics, RequestRecord
from router.openapi_doc import ApiApp
from router.prefix import adapter_salt, prefix_hashes
from router.responses import Answer, PromptCall, QueueTimeout, Reply, StartBy, retry_after
from router.scaling import ScalingRecord, ScalingSignals
from router.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from router.settings import IngressSettings
from router.tenants import (
    CLASS_HEADER,
    Caller,
    authenticate,
    check_adapter,
    check_admin,
    check_key_classes,
    resolve_caller,
)
from router.tools import ChatTemplates

logger = logging.getLogger(__name__)

ROUTES: tuple[tuple[str, str, str, type[BaseModel] | None], ...] = (
    ("GET", "/health", "health", None),
    ("GET", "/metrics", "prometheus_metrics", None),
    ("GET", "/v1/models", "models", None),
    ("GET", "/steps", "steps", None),
    ("POST", "/v1/completions", "completions", CompletionRequest),
    ("POST", "/v1/chat/completions", "chat_completions", ChatCompletionRequest),
    ("POST", "/v1/embeddings", "embeddings", EmbeddingRequest),
    ("POST", "/v1/load_lora_adapter", "load_lora_adapter", LoadLoRAAdapterRequest),
    ("POST", "/v1/unload_lora_adapter", "unload_lora_adapter", UnloadLoRAAdapterRequest),
)
"""(method, path, :class:`Ingress` method name, the model that validates the JSON body or
None) of every route; every POST route has a body."""
CLIENT_GONE = 499
"""Status of a response nobody reads: its client disconnected (nginx's code for it)."""
COMPLETIONS, CHAT, EMBEDDINGS = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
ANSWERED = (COMPLETIONS, CHAT, EMBEDDINGS)
"""The routes :meth:`Ingress.answer` answers a body of (a batch line's ``url``)."""

T = TypeVar("T")


def make_app() -> ApiApp:
    """A FastAPI app with the API's error format and CORS, and no routes yet."""
    app = ApiApp(title="iterserve", summary="OpenAI-compatible LLM serving")
    app.add_middleware(ConfiguredCORS)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        return JSONResponse(err.body(), status_code=exc.status_code)

    return app


def add_routes(app: ApiApp, ingress: "Ingress | type[Ingress]") -> None:
    """Route :data:`ROUTES` to ``ingress``'s methods: an :class:`Ingress` instance (bound
    methods), or a subclass that Ray Serve's ``serve.ingress`` binds per replica. The
    served document declares each POST route's body (:mod:`router.openapi_doc`); the
    handler still reads and validates it itself."""
    for method, path, name, body in ROUTES:
        endpoint = getattr(ingress, name)
        if body is None:
            app.add_api_route(path, endpoint, methods=[method])
        else:
            app.add_body_route(path, endpoint, body)


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the body was read before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Ingress:
    """The API over a set of replicas.

    Args:
        replicas: the replicas requests are sent to.
        settings: :class:`IngressSettings` fields.
        watch_disconnects: abort a non-streamed request as soon as its client
            disconnects (:meth:`_collect`). Neither uvicorn nor Ray Serve stops such a
            handler itself; False only for tests of what happens without it.
        step_log: where request events are recorded and ``GET /steps`` reads recent
            steps (the one-process server's replica); None: ``GET /steps`` is a 404.
    """

    def __init__(
        self,
        replicas: Replicas,
        settings: dict[str, Any],
        watch_disconnects: bool = True,
        step_log: StepEvents | None = None,
    ) -> None:
        self.watch_disconnects = watch_disconnects
        self.step_log = step_log
        self.settings = IngressSettings(**settings)
        ConfiguredCORS.origins = self.settings.allowed_origins
        self.replicas = replicas
        self.classes = make_classes(self.settings.traffic_classes)
        self.queue_bounds = {
            name: queue_bound(c, self.settings.max_queue_time_s) for name, c in self.classes.items()
        }
        """Each class's :func:`queue_bound` with this server's ``max_queue_time_s``."""
        self.api_keys = self.settings.all_api_keys()
        check_key_classes(self.api_keys, self.classes)
        self.admission = IngressAdmission(
            self.classes,
            policy=policy_from_spec(self.settings.policy),
            enabled=self.settings.admission,
        )
        self.adapters: dict[str, str] = dict(self.settings.lora_adapters)
        """The LoRA adapters served: name -> directory (``lora_adapters``, and those
        loaded at run time)."""
        if self.settings.model_name in self.adapters:
            raise ValueError(
                f"lora_adapters: {self.settings.model_name!r} is the base model's name"
            )
        self._adapters_loaded = False
        """The configured adapters were loaded on a replica (at the first model info)."""
        self._info: ModelInfo | None = None
        self._templates: ChatTemplates | None = None
        """The chat templates, once the tokenizer is known (:meth:`_model_info`)."""
        self._info_lock = asyncio.Lock()
        self._created = int(time.time())
        self.metrics = IngressMetrics(
            self.settings.model_name,
            {k: (c.ttft_slo_s, c.tpot_slo_s) for k, c in self.classes.items()},
            replicas.stats,
            lambda: self.admission.held,
            replicas.count,
            self.settings.num_replicas,
        )
        self.scaling: ScalingSignals | None = None
        """Each class's traffic for the autoscaler (None: a fixed fleet)."""
        self.scaling_decision: ScalingRecord | None = None
        """The autoscaler's last decision, once the ingress has read one."""
        if self.settings.autoscaling is not None:
            self.scaling = ScalingSignals(
                self.classes,
                self.settings.autoscaling["window_s"],
                self.admission.held_arrivals,
            )
            self.metrics.on_end = self.scaling.ended

    # -- routes ------------------------------------------------------------------------
    # (No `from __future__ import annotations` in this module: FastAPI reads the
    # annotations at runtime to tell the Request parameter from a query parameter.)

    async def health(self) -> Response:
        """200 once a replica is up (the body lists replicas' load); else 503."""
        try:
            info = await asyncio.wait_for(self._model_info(), timeout=5)
        except (ApiError, TimeoutError):
            return self._error(ApiError(503, "no model replica is ready yet", code="not_ready"))
        replicas = [
            {
                "replica": rid,
                "kv_usage": round(s.kv_usage, 4),
                "num_kv_blocks_free": s.num_kv_blocks_free,
                "running": s.total_running,
                "waiting": sum(s.waiting_requests.values()),
            }
            for rid, s in self.replicas.snapshots().items()
        ]
        num = self.replicas.count()
        if num == 0:
            return self._error(ApiError(503, "no model replica is running", code="not_ready"))
        body = {
            "status": "ok",
            "num_replicas": num,
            "replicas": replicas,
            "held": self.admission.held,
            "weights": {"format": info.weight_format, "bytes": info.weight_bytes},
        }
        if self.scaling_decision is not None:
            body["autoscaling"] = asdict(self.scaling_decision)
        return JSONResponse(body)

    async def prometheus_metrics(self) -> Response:
        """Prometheus exposition of every ``iterserve:`` metric (:mod:`router.metrics`)."""
        return Response(self.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        try:
            authenticate(self.api_keys, request.headers.get("authorization"))
            info = await self._model_info()
        except ApiError as e:
            return self._error(e)
        base = self.settings.model_name
        card = {"object": "model", "created": self._created, "owned_by": "iterserve"}
        # What /v1/embeddings answers with (the adapters' embeddings are pooled alike).
        embedding = {
            "embedding_pooling": info.embedding_pooling,
            "embedding_dimensions": sorted({info.embedding_size, *info.embedding_dimensions})
            if info.embedding_size
            else [],
        }
        data = [
            {
                "id": base,
                **card,
                "root": base,
                "parent": None,
                "max_model_len": info.limits.max_model_len,
                "weight_format": info.weight_format,
                "weight_bytes": info.weight_bytes,
                "chat_template": self._templates.describe() if self._templates else None,
                "tool_call_parser": self.settings.tool_call_parser,
                **embedding,
            }
        ]
        data += [
            {
                "id": name,
                **card,
                "root": path,
                "parent": base,
                "max_model_len": info.limits.max_model_len,
                **embedding,
            }
            for name, path in self.adapters.items()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def load_lora_adapter(self, request: Request) -> Response:
        """``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` (vLLM's route): check
        the adapter on a replica and serve it under ``lora_name``; every replica, and each
        one started later, reads it from ``lora_path`` on its first request there. 404
        unless ``allow_runtime_lora_updates``; 403 for a key that is not ``admin``; 400 for
        a name in use or an adapter that cannot be served (nothing served changes)."""
        try:
            body = await self._runtime_lora_body(request, LoadLoRAAdapterRequest)
            name = body.lora_name
            if name == self.settings.model_name or name in self.adapters:
                raise ApiError(
                    400,
                    f"the LoRA adapter {name!r} has already been loaded",
                    param="lora_name",
                    code="invalid_value",
                )
            await self._model_info()
            await self.replicas.load_lora(LoRARequest(name, body.lora_path))
            self.adapters[name] = body.lora_path
        except ApiError as e:
            return self._error(e)
        logger.info("LoRA adapter %r loaded from %s", name, body.lora_path)
        return Response(
            f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain"
        )

    async def unload_lora_adapter(self, request: Request) -> Response:
        """``POST /v1/unload_lora_adapter {"lora_name"}`` (vLLM's route): stop serving the
        adapter; every running replica forgets it, and requests running with it finish
        with it. 404 unless ``allow_runtime_lora_updates``, and for an unknown name; 403
        for a key that is not ``admin``."""
        try:
            body = await self._runtime_lora_body(request, UnloadLoRAAdapterRequest)
            name = body.lora_name
            if self.adapters.pop(name, None) is None:
                raise ApiError(
                    404,
                    f"the LoRA adapter {name!r} cannot be found",
                    param="lora_name",
                    code="model_not_found",
                )
            self.metrics.forget_model(name)
            await self.replicas.unload_lora(name)
        except ApiError as e:
            return self._error(e)
        logger.info("LoRA adapter %r unloaded", name)
        return Response(
            f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain"
        )

    async def _runtime_lora_body(self, request: Request, schema: type[BaseModel]) -> Any:
        """The body of a load or unload call, once the route is enabled and the key is an
        admin's.

        Raises:
            ApiError: 404 (not enabled), 401/403 (key), 400/413 (body).
        """
        if not self.settings.allow_runtime_lora_updates:
            raise ApiError(
                404,
                f"{request.url.path}: loading adapters at run time is off "
                "(allow_runtime_lora_updates)",
                code="not_found",
            )
        check_admin(self.api_keys, request.headers.get("authorization"))
        return fmt.validate(await self._read_json(request), schema)

    async def steps(self, request: Request) -> Response:
        """``GET /steps[?seconds=S]``: the step log's header and its records of the last
        ``S`` seconds (default: all kept), as ``{"records": [...]}``
        (:mod:`engine.core.step_log` gives the format). The API key rules of ``/v1/models``
        apply. 404 when no step history is kept (``step_history: 0``, or replicas on
        Ray Serve); 400 for a bad ``seconds``."""
        try:
            authenticate(self.api_keys, request.headers.get("authorization"))
            if self.step_log is None:
                raise ApiError(
                    404,
                    "no step history is kept here: it needs the one-process server "
                    "(num_replicas: 1) and step_history > 0",
                    code="not_found",
                )
            since = None
            raw = request.query_params.get("seconds")
            if raw is not None:
                try:
                    seconds = float(raw)
                except ValueError:
                    seconds = -1.0
                if not seconds >= 0:
                    raise ApiError(
                        400,
                        f"seconds: expected a number >= 0, got {raw!r}",
                        param="seconds",
                        code="invalid_value",
                    )
                since = time.monotonic() - seconds
            return JSONResponse({"records": self.step_log.recent(since)})
        except ApiError as e:
            return self._error(e)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def embeddings(self, request: Request) -> Response:
        """``POST /v1/embeddings``: one vector per input (:mod:`router.embeddings`), with
        the same checks, admission, queue bound and disconnect handling as a completion
        not streamed."""
        arrival = time.monotonic()
        try:
            authenticate(self.api_keys, request.headers.get("authorization"))
            body = await self._read_json(request)
            reply, caller = await self._open_embeddings(
                body, request.headers, arrival, bounded=True
            )
        except ClientDisconnect:
            logger.info("POST %s: client disconnected while sending the body", EMBEDDINGS)
            return Response(status_code=CLIENT_GONE)
        except Exception as e:  # noqa: BLE001 - answered; a bug of ours is logged
            return self._error(_failure(e))
        headers = self._headers(reply.rid, caller, reply.calls)
        try:
            out = await self._unless_gone(request, emb.collect(reply))
            if out is None:  # the client left; its calls are aborted below
                logger.info("%s: client disconnected; request aborted", reply.rid)
                return Response(status_code=CLIENT_GONE)
            return JSONResponse(out, headers=headers)
        except ReplicaLost as e:
            return self._error(_lost(e))
        except QueueTimeout as e:
            self._refused(reply.rid, reply.calls, caller.traffic_class)(e)
            return self._error(e.error(retry_after(e.bound_s)))
        except ApiError as e:  # the request failed in the engine, or a re-send was refused
            return self._error(e)
        finally:
            self._cancel(reply.calls)

    # -- one request -------------------------------------------------------------------

    async def _serve(self, request: Request, chat: bool) -> Response:
        arrival = time.monotonic()
        try:
            # The key first, as vLLM's --api-key: a caller without one learns nothing,
            # not even which of its fields are wrong.
            authenticate(self.api_keys, request.headers.get("authorization"))
            body = await self._read_json(request)
            reply, caller = await self._open(body, chat, request.headers, arrival, bounded=True)
        except ClientDisconnect:  # the client's act, not an error of ours
            logger.info(
                "%s %s: client disconnected while sending the body",
                request.method,
                request.url.path,
            )
            return Response(status_code=CLIENT_GONE)
        except Exception as e:  # noqa: BLE001 - answered; a bug of ours is logged
            return self._error(_failure(e))
        headers = self._headers(reply.rid, caller, reply.calls)
        refused = self._refused(reply.rid, reply.calls, caller.traffic_class)
        if reply.req.stream:
            chunks = responses.stream(
                reply, reply.start_by, self.settings.stream_keepalive_s, refused
            )
            return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)
        try:
            body = await self._collect(request, reply)
            if body is None:  # the client left; its calls are aborted below
                logger.info("%s: client disconnected; request aborted", reply.rid)
                return Response(status_code=CLIENT_GONE)
            return JSONResponse(body, headers=headers)
        except ReplicaLost as e:
            return self._error(_lost(e))
        except QueueTimeout as e:
            refused(e)
            return self._error(e.error(retry_after(e.bound_s)))
        except ApiError as e:  # the request failed in the engine, or a re-send was refused
            return self._error(e)
        finally:
            self._cancel(reply.calls)

    async def answer(
        self, path: str, body: dict[str, Any], headers: Mapping[str, str] | None = None
    ) -> Answer:
        """Answer one request body, not streamed, as ``POST path`` (one of
        :data:`ANSWERED`) with ``headers`` (lower-case names) would: the same checks,
        admission, dispatch and body, and the same status and error body when it fails.
        ``request_id`` is the response's ``x-request-id`` (empty on an error). Unlike
        ``POST``, no queue bound applies (:func:`queue_bound`): no client waits on a
        connection, and a batch line waits for its turn however long that takes.

        Raises:
            ValueError: ``path`` is not one of :data:`ANSWERED`. The request's own faults
                raise nothing (its answer is the API's error; a bug of ours, a logged 500).
        """
        if path not in ANSWERED:
            raise ValueError(f"{path!r} is not one of {ANSWERED}")
        arrival = time.monotonic()
        headers = headers or {}
        try:
            authenticate(self.api_keys, headers.get("authorization"))
            # An embeddings body has no `stream`: its schema refuses the field, as POST does.
            if path != EMBEDDINGS and body.get("stream"):
                raise ApiError(
                    400,
                    "stream: this call answers with the whole response; it cannot stream",
                    param="stream",
                    code="invalid_value",
                )
            if path == EMBEDDINGS:
                reply, _ = await self._open_embeddings(body, headers, arrival)
                work = emb.collect(reply)
            else:
                reply, _ = await self._open(body, path == CHAT, headers, arrival)
                work = responses.collect(reply)
        except Exception as e:  # noqa: BLE001 - answered; a bug of ours is logged
            err = _failure(e)
            return Answer(err.status, "", err.body())
        try:
            out = await work
        except ReplicaLost as e:
            err = _lost(e)
            return Answer(err.status, "", err.body())
        except ApiError as e:  # the request failed in the engine, or a re-send was refused
            return Answer(e.status, "", e.body())
        finally:
            self._cancel(reply.calls)
        return Answer(200, reply.rid, out, out["usage"].get("completion_tokens", 0))

    async def _open(
        self,
        body: dict[str, Any],
        chat: bool,
        headers: Mapping[str, str],
        arrival: float,
        bounded: bool = False,
    ) -> tuple[Reply, Caller]:
        """Validate ``body``, resolve its caller, tokenize its prompts and send each to a
        replica once admitted; the reply to build once every replica accepted its prompt.

        ``bounded``: hold the request to its class's :func:`queue_bound` from ``arrival``
        (admission's hold included); the reply's ``start_by`` is then its deadline.

        Raises:
            ApiError: the request is refused (400, 403, 404, 429, 503; 429 too when
                admission held it for all of its bound); the calls already sent are
                cancelled, as they are when the client leaves meanwhile.
        """
        calls: list[PromptCall] = []
        try:
            req = fmt.validate(body, ChatCompletionRequest if chat else CompletionRequest)
            fmt.check_served(
                req, chat, [self.settings.model_name, *self.adapters], self.settings.max_n
            )
            caller, lora, start_by = self._route(req.model, req.priority, headers, arrival, bounded)
            info = await self._model_info()
            use = tools.tool_use(req, self.settings.tool_call_parser) if chat else None
            prompts = fmt.prompts(req, chat, info.tokenizer, self._templates, use)
            scores_only = fmt.scores_only(req, chat)
            params = fmt.sampling_params(req, chat, use)
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            await self._send(calls, rid, prompts, params, caller, info, arrival, start_by, lora)
        except BaseException:  # refused, a bug of ours, or the client left meanwhile
            self._cancel(calls)
            raise
        reply = Reply(req, chat, rid, req.model, info.tokenizer, calls, scores_only, start_by, use)
        return reply, caller

    async def _open_embeddings(
        self,
        body: dict[str, Any],
        headers: Mapping[str, str],
        arrival: float,
        bounded: bool = False,
    ) -> tuple[emb.EmbeddingReply, Caller]:
        """:meth:`_open` for ``POST /v1/embeddings``: each input sent to a replica once
        admitted, as a prefill-only request (:class:`PoolingParams`).

        Raises:
            ApiError: as :meth:`_open`'s; 400 too for ``dimensions`` the model does not
                serve and for more inputs than ``max_embedding_inputs``.
        """
        calls: list[PromptCall] = []
        try:
            req = fmt.validate(body, EmbeddingRequest)
            fmt.check_model(req.model, [self.settings.model_name, *self.adapters])
            caller, lora, start_by = self._route(req.model, req.priority, headers, arrival, bounded)
            info = await self._model_info()
            emb.check(req, info, self.settings.max_embedding_inputs)
            prompts = emb.prompts(req, info.tokenizer)
            rid = f"embd-{uuid.uuid4().hex}"
            params = emb.pooling_params(req)
            await self._send(calls, rid, prompts, params, caller, info, arrival, start_by, lora)
        except BaseException:  # refused, a bug of ours, or the client left meanwhile
            self._cancel(calls)
            raise
        return emb.EmbeddingReply(rid, req.model, calls, req.encoding_format, start_by), caller

    def _route(
        self,
        model: str,
        priority: int | None,
        headers: Mapping[str, str],
        arrival: float,
        bounded: bool,
    ) -> tuple[Caller, LoRARequest | None, StartBy | None]:
        """The caller of a request for served ``model`` (asking for ``priority``), its
        adapter (None: the base model), and its deadline to start when ``bounded``.

        Raises:
            ApiError: 401/403 (key, class, priority or adapter not allowed).
        """
        caller = resolve_caller(
            self.api_keys,
            self.classes,
            headers.get("authorization"),
            headers.get(CLASS_HEADER),
            priority,
        )
        lora = None
        if model != self.settings.model_name:
            check_adapter(caller, model)
            lora = LoRARequest(model, self.adapters[model])
        start_by = None
        bound = self.queue_bounds[caller.traffic_class]
        if bounded and bound is not None:
            start_by = StartBy(arrival + bound[0], *bound)
        return caller, lora, start_by

    async def _send(
        self,
        calls: list[PromptCall],
        rid: str,
        prompts: list[tuple[list[int], str]],
        params: SamplingParams | PoolingParams,
        caller: Caller,
        info: ModelInfo,
        arrival: float,
        start_by: StartBy | None,
        lora: LoRARequest | None,
    ) -> None:
        """Dispatch each of ``prompts`` (``(token ids, text)``) in turn, appending its call
        to ``calls`` once a replica accepted it (the caller cancels them on failure); one
        prompt's call id is ``rid``, several prompts' ``rid-<index>``.

        Raises:
            ApiError: as :meth:`_dispatch`.
        """
        for p, (ids, text) in enumerate(prompts):
            call_id = rid if len(prompts) == 1 else f"{rid}-{p}"
            call, record = await self._dispatch(
                call_id, ids, params, caller, info, arrival, start_by, lora
            )
            calls.append(PromptCall(ids, text, call, record=record))

    async def _dispatch(
        self,
        rid: str,
        ids: list[int],
        params: SamplingParams | PoolingParams,
        caller: Caller,
        info: ModelInfo,
        arrival: float,
        start_by: StartBy | None = None,
        lora: LoRARequest | None = None,
    ) -> tuple[ReplicaCall, RequestRecord]:
        """Admit one prompt (within ``start_by``, if given) and send it to a replica with
        its adapter (None: the base model); its call once accepted, and the call's metrics
        record. An embedding (``PoolingParams``) has no output tokens: 0 ``max_tokens``."""
        embedding = isinstance(params, PoolingParams)
        max_tokens = 0 if embedding else params.max_tokens
        bs = self.settings.prefix_block_size
        salt = adapter_salt(lora.name) if lora is not None else 0
        hashes = prefix_hashes(ids, bs, salt=salt) if bs else ()
        shape = RequestShape(len(ids), caller.traffic_class, caller.priority, hashes, lora)
        # A request that can never fit skips admission: the replica answers it with a
        # 400 that has the numbers, not a 429.
        held_s = 0.0
        hold: int | None = None
        log = self.step_log
        if log is not None:
            log.arrival(rid, arrival, caller.traffic_class, caller.priority, len(ids), max_tokens)
        if self.scaling is not None:
            self.scaling.arrived(caller.traffic_class, arrival, len(ids), max_tokens or 0)
        try:
            if info.limits.fits(len(ids), max_tokens):
                if self.admission.enabled:
                    # Counted as held, ahead of later arrivals, until the replica has queued
                    # it: a burst admitted before any of it is queued must not all pass.
                    hold = self.admission.hold(caller.traffic_class, arrival, len(ids))
                try:
                    held_s = await self._admit(caller, shape, max_tokens, arrival, start_by, hold)
                except ApiError as e:
                    if log is not None:
                        log.refused(rid, time.monotonic(), e.message)
                    if self.scaling is not None:
                        self.scaling.refused(caller.traffic_class)
                    raise
                if log is not None:
                    log.admitted(rid, time.monotonic(), held_s)
            record = self.metrics.request(
                caller.traffic_class,
                arrival,
                len(ids),
                held_s,
                lora.name if lora is not None else None,
                embedding=embedding,
            )
            dispatch = self.replicas.call(rid, ids, params, shape, record)
            try:
                await dispatch.start()
            except BaseException:  # refused, or the client left while it was sent
                dispatch.cancel()
                raise
        finally:
            if hold is not None:
                self.admission.release(hold)
        return dispatch, record

    async def _collect(self, request: Request, reply: Reply) -> dict | None:
        """The whole response; None if the client disconnected first (:meth:`_unless_gone`).

        Raises:
            QueueTimeout: a prompt had not started by ``reply.start_by``.
            ReplicaLost: a replica failed after the request produced tokens.
        """
        return await self._unless_gone(request, responses.collect(reply, reply.start_by))

    async def _unless_gone(self, request: Request, response: Coroutine[Any, Any, T]) -> T | None:
        """What ``response`` returns; None if the client disconnected first (only watched
        when ``watch_disconnects``). The caller then cancels the calls, which aborts their
        engine requests and frees their KV blocks.

        Raises:
            What ``response`` raises.
        """
        if not self.watch_disconnects:
            return await response
        work = asyncio.ensure_future(response)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()  # it ends at its next await: not done yet on return
        return work.result() if work.done() and not work.cancelled() else None

    @staticmethod
    def _cancel(calls: list[PromptCall]) -> None:
        for c in calls:
            c.dispatch.cancel()

    @staticmethod
    def _headers(rid: str, caller: Caller, calls: list[PromptCall]) -> dict[str, str]:
        """A response's ``x-`` headers: its id, class, priority and first prompt's replica."""
        return {
            "x-request-id": rid,
            "x-iterserve-class": caller.traffic_class,
            "x-iterserve-priority": str(caller.priority),
            "x-iterserve-replica": calls[0].dispatch.replica,
        }

    def _refused(
        self, rid: str, calls: list[PromptCall], traffic_class: str
    ) -> Callable[[QueueTimeout], None]:
        """What to do when request ``rid`` times out in a queue (before its ``calls`` are
        cancelled): count the refusal once, and end its calls' records without counting
        them as aborted."""

        def refused(e: QueueTimeout) -> None:
            self.metrics.reject(traffic_class, "queue_timeout")
            for c in calls:
                if c.record is not None:
                    c.record.refused()
            logger.info("%s: refused: %s", rid, e)

        return refused

    # -- helpers -----------------------------------------------------------------------

    async def _admit(
        self,
        caller: Caller,
        shape: RequestShape,
        max_tokens: int | None,
        arrival: float,
        start_by: StartBy | None = None,
        hold: int | None = None,
    ) -> float:
        """Wait for admission, until ``start_by`` at most; the seconds held. ``hold``: the
        request's hold (:meth:`router.admission.IngressAdmission.hold`), which the caller
        releases.

        Raises:
            ApiError: 429 with Retry-After when admission refuses, or still holds the
                request at ``start_by`` (reason ``queue_timeout``).
        """
        admit = self.admission.admit(
            lambda: self.replicas.loads(shape),
            caller.traffic_class,
            shape.prompt_tokens,
            max_tokens or 0,
            caller.priority,
            arrival,
            hold,
        )
        try:
            if start_by is None:
                return await admit
            return await asyncio.wait_for(admit, start_by.at - time.monotonic())
        except TimeoutError:
            self.metrics.reject(caller.traffic_class, "queue_timeout")
            assert start_by is not None
            timeout = QueueTimeout(start_by.bound_s, start_by.source)
            raise timeout.error(retry_after(start_by.bound_s)) from None
        except AdmissionRejected as e:
            self.metrics.reject(caller.traffic_class, e.kind)
            retry = str(int(e.retry_after_s))
            raise ApiError(
                429,
                f"server busy, retry after {retry} s ({e.reason})",
                code="rate_limit_exceeded",
                headers={"Retry-After": retry},
            ) from None

    async def _model_info(self) -> ModelInfo:
        """The replicas' tokenizer and limits, fetched from one replica on first use.

        Raises:
            ApiError: 503 when no replica answers.
        """
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    info = await self.replicas.info()
                    await self._load_configured_adapters()
                    self._templates = ChatTemplates.of(info.tokenizer, self.settings.chat_template)
                    self._info = info
        return self._info

    async def _load_configured_adapters(self) -> None:
        """Load ``lora_adapters`` on a replica, which checks them; one that cannot be
        served is logged and dropped (the one-process server refuses to start on it
        instead: :func:`deploy.local_server.build_local`)."""
        for name, path in list(self.settings.lora_adapters.items()):
            try:
                await self.replicas.load_lora(LoRARequest(name, path))
            except ApiError as e:
                if e.status != 400:
                    raise
                logger.error("lora_adapters: %s; not served", e.message)
                self.adapters.pop(name, None)

    async def _read_json(self, request: Request) -> dict:
        limit = self.settings.max_request_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(
                413,
                f"request body of {declared} bytes is over the limit of {limit} bytes",
                code="request_too_large",
            )
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise ApiError(
                    413,
                    f"request body is over the limit of {limit} bytes",
                    code="request_too_large",
                )
        try:
            data = json.loads(body)
            if b"\\u" in body or b"\xed" in body:  # how a lone UTF-16 surrogate gets in
                json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:  # a string no tokenizer can encode
            raise ApiError(
                400,
                "request body is not valid Unicode text: a lone UTF-16 "
                f"surrogate ({e.object[e.start : e.end]!a})",
                code="invalid_json",
            ) from None
        except ValueError as e:
            raise ApiError(
                400, f"request body is not valid JSON: {e}", code="invalid_json"
            ) from None
        except RecursionError:
            raise ApiError(
                400, "request body is not valid JSON: nested too deeply", code="invalid_json"
            ) from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object", code="invalid_json")
        return data

    @staticmethod
    def _error(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def queue_bound(cls: TrafficClass, max_queue_time_s: float) -> tuple[float, str] | None:
    """The longest a request of class ``cls`` may wait before it starts, in seconds from
    its arrival at the ingress, and what set it (for the refusal's message); None for a
    class that is never refused for its SLO (``rejectable: false``, as ``batch``: work
    that must run waits its turn however long, its streams kept alive by comments).

    The wait ends with the request's first token (:func:`router.responses.merged`) and
    covers admission's hold, the replica's queue and the prefill. The bound is the larger
    of the class's TTFT SLO and ``max_queue_time_s``: a class whose SLO is longer may wait
    up to it; for the others ``max_queue_time_s`` is the floor, as their SLO is a target
    that admission already refuses by when it predicts a miss, and a request admitted and
    then late is cut only past the floor.
    """
    if not cls.rejectable:
        return None
    if cls.ttft_slo_s > max_queue_time_s:
        return cls.ttft_slo_s, f"the {cls.name} class's TTFT SLO, ttft_slo_s"
    return max_queue_time_s, "the server's max_queue_time_s"


def _failure(e: Exception) -> ApiError:
    """The answer to a request whose opening raised ``e``; logs a bug of ours (call it in
    the ``except`` block)."""
    if isinstance(e, ApiError):
        return e
    logger.exception("request failed")
    return ApiError(500, "internal error; see the server log", code="internal_error")


def _lost(e: ReplicaLost) -> ApiError:
    """The answer to a non-streamed request whose replica failed and that could not
    move to another (:mod:`router.dispatch`)."""
    return ApiError(503, str(e), code="replica_lost", headers={"Retry-After": str(RETRY_AFTER_S)})
