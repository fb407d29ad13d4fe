"""Schemathesis over the live server's ``/openapi.json`` (as vLLM's CI runs it over its
own): generated requests, valid and not, to every operation. None may get a 5xx or hang,
and an error must come in OpenAI's format.

The document is read as the server serves it. It declares the JSON request body of every
POST route with the schema of the pydantic model that validates it
(:mod:`router.openapi_doc`); the test checks that, and that the generated bodies reach
the handlers: each POST operation counts its cases sent with a JSON body that the
handler answered (not a rejection by the framework), prints the count, and needs one.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from pydantic import BaseModel
from schemathesis import GenerationMode

from router.ingress import ROUTES
from router.openapi_doc import REF
from tests.faults.conftest import KEY, LocalServer
from tests.serving_app import MODEL

pytestmark = pytest.mark.slow

EXAMPLES = 8
"""Generated cases per operation: a few, so the folder stays short on a slow host."""
MAX_TOKENS = 2
"""The cap on every generated request's output, for the same reason."""
BODIES = {path: body for method, path, _, body in ROUTES if method == "POST"}
"""Each POST route's body model (:data:`router.ingress.ROUTES`)."""


@pytest.fixture(scope="module")
def served_doc(fault_server: LocalServer) -> dict[str, Any]:
    """The server's ``/openapi.json``."""
    r = httpx.get(f"{fault_server.url}/openapi.json", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def api_schema(served_doc: dict[str, Any]):
    return schemathesis.openapi.from_dict(served_doc)


def test_the_served_document_declares_every_post_body(served_doc: dict[str, Any]):
    posts = {path for path, ops in served_doc["paths"].items() if "post" in ops}
    assert posts == set(BODIES), posts
    components = served_doc["components"]["schemas"]
    for path, model in BODIES.items():
        body = served_doc["paths"][path]["post"]["requestBody"]
        assert body["required"] is True, path
        assert set(body["content"]) == {"application/json"}, path
        ref = body["content"]["application/json"]["schema"]["$ref"]
        assert ref == REF.format(model=model.__name__), path
        schema = model.model_json_schema(ref_template=REF)
        for name, sub in [*schema.pop("$defs", {}).items(), (model.__name__, schema)]:
            assert components[name] == sub, (path, name)


def _bounded(body: Any, model: type[BaseModel] | None) -> None:
    """Make a generated body cheap to serve: the served model's name (when it names one),
    at most :data:`MAX_TOKENS` tokens out where ``model`` (the route's body) generates."""
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    if model is None or "max_tokens" not in model.model_fields:
        return  # an embedding, an adapter's load: nothing to cap
    for field in ("max_tokens", "max_completion_tokens"):
        if field in body and isinstance(body[field], int | None):
            body[field] = MAX_TOKENS
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS
    if isinstance(body.get("min_tokens"), int):
        body["min_tokens"] = min(body["min_tokens"], MAX_TOKENS)


def _send(case, base_url: str) -> tuple[httpx.Response, bool]:
    """Send ``case`` with httpx, the client the rest of the suite uses; the response, and
    whether the case had a JSON body."""
    kw = case.as_transport_kwargs(base_url, {"Authorization": f"Bearer {KEY}"})
    body = kw.get("json", _NONE)
    if body is _NONE:
        content = kw.get("data")
    else:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.request(
        kw["method"],
        kw["url"],
        params=kw.get("params"),
        headers=kw.get("headers"),
        content=content,
        timeout=120,
    )
    return response, body is not _NONE


_NONE = object()


def _framework_rejection(case, response: httpx.Response) -> bool:
    """``response`` came from FastAPI, not the route's handler: its request validation
    (422), or an HTTP error of the routing, which :func:`router.ingress.make_app` words as
    ``"<METHOD> <path>: <detail>"``."""
    if response.status_code == 422:
        return True
    if response.status_code < 400:
        return False
    message = response.json().get("error", {}).get("message", "")
    return message.startswith(f"{case.method} {case.formatted_path}: ")


@pytest.mark.parametrize(
    ("method", "path", "mode"),
    [
        (method, path, mode)
        for method, path, _, _ in ROUTES
        for mode in (
            (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
            if method == "POST"
            else (GenerationMode.POSITIVE,)
        )
    ],
)
def test_no_generated_request_gets_a_5xx(
    api_schema, fault_server: LocalServer, method: str, path: str, mode: GenerationMode
):
    seen: list[int] = []
    reached: list[int] = []  # the statuses of cases with a JSON body the handler answered

    @given(case=api_schema[path][method].as_strategy(mode))
    @settings(
        max_examples=EXAMPLES if method == "POST" else 2,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def check(case) -> None:
        _bounded(case.body, BODIES.get(path))
        response, with_json = _send(case, fault_server.url)
        seen.append(response.status_code)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert isinstance(error["message"], str) and error["message"], response.text
            assert isinstance(error["type"], str), response.text
        if with_json and not _framework_rejection(case, response):
            reached.append(response.status_code)

    check()
    assert seen  # the strategy generated requests, and they were sent
    print(
        f"\n{method} {path} {mode.value}: {len(seen)} cases sent, {len(reached)} reached "
        f"the handler with a JSON body ({reached.count(200)} answered 200)"
    )
    if method == "POST":
        assert reached, seen
    if mode is GenerationMode.NEGATIVE:
        assert all(400 <= s < 500 for s in seen), seen
    fault_server.wait_idle()
