"""The ingress: OpenAI-compatible REST routes, validation, admission, SSE streaming.

One request's path: the body is read (413 past the size limit) and validated (400 naming
the field), the model checked (404), the caller resolved from its API key
(:mod:`router.tenants`), the prompt tokenized (chat template for chat), admission asked
(:mod:`router.admission`; 429 with Retry-After), and the request sent to a replica chosen
by :class:`router.routing.LoadAwareRouter` (:mod:`router.dispatch`). The replica's step
items become OpenAI chunks (SSE ending with ``data: [DONE]``) or one response
(:mod:`router.openai_format`).

If a replica dies after the request streamed tokens, the stream ends with an error
event. A client that disconnects cancels the replica call, which aborts the engine
request before its next step and frees its KV blocks.
"""

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from policies import classes_from_fields, policy_from_spec
from policies.limits import RequestLimits
from router import openai_format as fmt
from router.admission import AdmissionRejected, IngressAdmission
from router.cors import ConfiguredCORS
from router.dispatch import REPLICA_LOST, Dispatch, ReplicaLost
from router.errors import ApiError
from router.routing import RequestShape, load_view
from router.schemas import ChatCompletionRequest, CompletionRequest
from router.settings import IngressSettings
from router.tenants import CLASS_HEADER, resolve_caller

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _ModelInfo:
    tokenizer: Any
    limits: RequestLimits
    """The replicas' limits, the engine's own (the replica re-checks with them)."""


@dataclass(slots=True)
class _Choice:
    """One of the ``n`` sequences, accumulated for a non-streamed response."""

    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)


app = FastAPI(title="iterserve", summary="OpenAI-compatible LLM serving")
app.add_middleware(ConfiguredCORS)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return JSONResponse(err.body(), status_code=exc.status_code)


@serve.ingress(app)
class OpenAIIngress:
    """The HTTP ingress deployment.

    Args:
        replicas: handle to the model-replica deployment.
        settings: :class:`IngressSettings` fields.
    """

    def __init__(self, replicas: DeploymentHandle, settings: dict[str, Any]) -> None:
        self.settings = IngressSettings(**settings)
        ConfiguredCORS.origins = self.settings.allowed_origins
        self.replicas = replicas.options(stream=True)
        self._info_handle = replicas
        self.classes = classes_from_fields(self.settings.traffic_classes)
        self.admission = IngressAdmission(
            self.classes, policy=policy_from_spec(self.settings.policy),
            enabled=self.settings.admission,
        )
        self._info: _ModelInfo | None = None
        self._info_lock = asyncio.Lock()
        self._created = int(time.time())

    # -- routes ------------------------------------------------------------------------
    # (No `from __future__ import annotations` in this module: FastAPI reads the
    # annotations at runtime to tell the Request parameter from a query parameter.)

    @app.get("/health")
    async def health(self) -> Response:
        """200 once a replica is up (the body lists replicas' load); else 503."""
        try:
            await asyncio.wait_for(self._model_info(), timeout=5)
        except (ApiError, TimeoutError):
            return self._error(ApiError(503, "no model replica is ready yet",
                                        code="not_ready"))
        view = load_view(self.replicas.app_name, self.replicas.deployment_name)
        snaps = view.snapshots() if view is not None else {}
        replicas = [
            {"replica": rid.unique_id, "kv_usage": round(s.kv_usage, 4),
             "num_kv_blocks_free": s.num_kv_blocks_free, "running": s.total_running,
             "waiting": sum(s.waiting_requests.values())}
            for rid, s in snaps.items()
        ]
        num = len(view.curr_replicas) if view is not None else 0
        if num == 0:
            return self._error(ApiError(503, "no model replica is running", code="not_ready"))
        return JSONResponse({"status": "ok", "num_replicas": num, "replicas": replicas,
                             "held": self.admission.held})

    @app.get("/v1/models")
    async def models(self) -> Response:
        try:
            info = await self._model_info()
        except ApiError as e:
            return self._error(e)
        return JSONResponse({"object": "list", "data": [{
            "id": self.settings.model_name, "object": "model", "created": self._created,
            "owned_by": "iterserve", "max_model_len": info.limits.max_model_len,
        }]})

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    # -- one request -------------------------------------------------------------------

    async def _serve(self, request: Request, chat: bool) -> Response:
        arrival = time.monotonic()
        try:
            body = await self._read_json(request)
            req = fmt.validate(body, ChatCompletionRequest if chat else CompletionRequest)
            if req.model != self.settings.model_name:
                raise ApiError(404, f"model {req.model!r} does not exist; this server "
                                    f"serves {self.settings.model_name!r}", param="model",
                               code="model_not_found")
            if req.n > self.settings.max_n:
                raise ApiError(400, f"n={req.n} is over the server's cap of "
                                    f"{self.settings.max_n}", param="n", code="invalid_value")
            caller = resolve_caller(self.settings.api_keys, self.classes,
                                    request.headers.get("authorization"),
                                    request.headers.get(CLASS_HEADER), req.priority)
            info = await self._model_info()
            ids = fmt.prompt_ids(req, chat, info.tokenizer)
            params = fmt.sampling_params(req, chat)
            shape = RequestShape(len(ids), caller.traffic_class, caller.priority)
            # A request that can never fit skips admission: the replica answers it with
            # a 400 that has the numbers, not a 429.
            if info.limits.fits(len(ids), params["max_tokens"]):
                await self._admit(caller, len(ids), params["max_tokens"], arrival)
            prefix = "chatcmpl" if chat else "cmpl"
            rid = f"{prefix}-{uuid.uuid4().hex}"
            dispatch = Dispatch(self.replicas, (rid, ids, params), shape)
            try:
                await dispatch.start()
            except BaseException:  # refused, or the client left while it was sent
                dispatch.cancel()
                raise
        except ApiError as e:
            return self._error(e)
        except Exception:  # a bug of ours: an OpenAI-shaped 500, and the server stays up
            logger.exception("request failed")
            return self._error(ApiError(500, "internal error; see the server log",
                                        code="internal_error"))
        headers = {"x-request-id": rid, "x-iterserve-class": caller.traffic_class,
                   "x-iterserve-priority": str(caller.priority),
                   "x-iterserve-replica": dispatch.replica}
        if req.stream:
            return StreamingResponse(self._stream(dispatch, req, chat, rid, info),
                                     media_type="text/event-stream", headers=headers)
        try:
            return JSONResponse(await self._collect(dispatch, req, chat, rid, info),
                                headers=headers)
        except ReplicaLost as e:
            return self._error(ApiError(503, str(e), code="replica_lost"))
        finally:
            dispatch.cancel()

    async def _collect(self, dispatch: Dispatch, req: Any, chat: bool, rid: str,
                       info: _ModelInfo) -> dict:
        choices = [_Choice() for _ in range(req.n)]
        async for item in dispatch.items():
            for o in item["outputs"]:
                c = choices[o["index"]]
                c.text.append(o["text"])
                c.token_ids.extend(o["token_ids"])
                if o["logprobs"]:
                    c.logprobs.extend(o["logprobs"])
                if o["finish_reason"]:
                    c.finish_reason, c.stop_reason = o["finish_reason"], o["stop_reason"]
        want_logprobs = fmt.wants_logprobs(req, chat)
        out = []
        for i, c in enumerate(choices):
            text = "".join(c.text)
            lp = (fmt.logprobs_object(info.tokenizer, c.token_ids, c.logprobs, req, chat)
                  if want_logprobs else None)
            choice: dict[str, Any] = {"index": i, "logprobs": lp,
                                      "finish_reason": c.finish_reason,
                                      "stop_reason": c.stop_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            out.append(choice)
        completion = sum(len(c.token_ids) for c in choices)
        return {
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.settings.model_name, "choices": out,
            "usage": fmt.usage(dispatch.prompt_tokens, completion),
        }

    async def _stream(self, dispatch: Dispatch, req: Any, chat: bool, rid: str,
                      info: _ModelInfo) -> AsyncIterator[str]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        want_logprobs = fmt.wants_logprobs(req, chat)
        completion = 0

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            data: dict[str, Any] = {"id": rid, "object": obj, "created": created,
                                    "model": self.settings.model_name, "choices": choices}
            if include_usage:
                data["usage"] = usage
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        try:
            if chat:
                for i in range(req.n):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
            async for item in dispatch.items():
                for o in item["outputs"]:
                    completion += len(o["token_ids"])
                    lp = (fmt.logprobs_object(info.tokenizer, o["token_ids"], o["logprobs"] or [],
                                         req, chat) if want_logprobs else None)
                    choice: dict[str, Any] = {"index": o["index"], "logprobs": lp,
                                              "finish_reason": o["finish_reason"]}
                    if o["finish_reason"]:
                        choice["stop_reason"] = o["stop_reason"]
                    if chat:
                        choice["delta"] = {"content": o["text"]} if o["text"] else {}
                    else:
                        choice["text"] = o["text"]
                    yield chunk([choice])
            if include_usage:
                yield chunk([], fmt.usage(dispatch.prompt_tokens, completion))
        except (ReplicaLost, ApiError) as e:
            err = e if isinstance(e, ApiError) else ApiError(503, str(e), code="replica_lost")
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            dispatch.cancel()
        yield "data: [DONE]\n\n"

    # -- helpers -----------------------------------------------------------------------

    async def _admit(self, caller: Any, prompt_tokens: int, max_tokens: int | None,
                     arrival: float) -> None:
        """Wait for admission. Raises ApiError 429 with Retry-After when refused."""
        try:
            await self.admission.admit(self._loads, caller.traffic_class, prompt_tokens,
                                       max_tokens or 0, caller.priority, arrival)
        except AdmissionRejected as e:
            retry = str(int(e.retry_after_s))
            raise ApiError(429, f"server busy, retry after {retry} s ({e.reason})",
                           code="rate_limit_exceeded", headers={"Retry-After": retry}) from None

    def _loads(self) -> list:
        view = load_view(self.replicas.app_name, self.replicas.deployment_name)
        return list(view.snapshots().values()) if view is not None else []

    async def _model_info(self) -> _ModelInfo:
        """The replicas' tokenizer and limits, fetched from one replica on first use.

        Raises:
            ApiError: 503 when no replica answers.
        """
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    try:
                        info = await self._info_handle.info.remote()
                    except REPLICA_LOST as e:
                        raise ApiError(503, f"no model replica is ready: {e}",
                                       code="not_ready") from e
                    self._info = _ModelInfo(**info)
        return self._info

    async def _read_json(self, request: Request) -> dict:
        limit = self.settings.max_request_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body of {declared} bytes is over the limit of "
                                f"{limit} bytes", code="request_too_large")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise ApiError(413, f"request body is over the limit of {limit} bytes",
                               code="request_too_large")
        try:
            data = json.loads(body)
        except ValueError as e:
            raise ApiError(400, f"request body is not valid JSON: {e}",
                           code="invalid_json") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object", code="invalid_json")
        return data

    @staticmethod
    def _error(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
