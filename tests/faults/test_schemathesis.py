"""Schemathesis over the live server's ``/openapi.json`` (as vLLM's CI runs it over its
own): generated requests, valid and not, to every operation. None may get a 5xx, and an
error must come in OpenAI's format.

The served document lists the routes; the handlers read their bodies themselves, so it
declares no request body. The test adds the API's own body schemas
(:class:`router.schemas.CompletionRequest`, :class:`router.schemas.ChatCompletionRequest`)
to the document it loads, so that the bodies are generated from them.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from router.schemas import ChatCompletionRequest, CompletionRequest
from tests.faults.conftest import KEY, LocalServer
from tests.serving_app import MODEL

pytestmark = pytest.mark.slow

EXAMPLES = 8
"""Generated cases per operation: a few, so the folder stays short on a slow host."""
MAX_TOKENS = 2
"""The cap on every generated request's output, for the same reason."""
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
REF = "#/components/schemas/{model}"


def with_bodies(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with the JSON request bodies of the generating routes declared."""
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in BODIES.items():
        schema = model.model_json_schema(ref_template=REF)
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
        }
    return doc


@pytest.fixture(scope="module")
def api_schema(fault_server: LocalServer):
    doc = httpx.get(f"{fault_server.url}/openapi.json", timeout=10).json()
    assert set(BODIES) <= set(doc["paths"]), doc["paths"]
    return schemathesis.openapi.from_dict(with_bodies(doc))


def _bounded(body: Any) -> None:
    """Make a generated body cheap to serve: the served model's name (when it names one),
    at most :data:`MAX_TOKENS` tokens out."""
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    for field in ("max_tokens", "max_completion_tokens"):
        if field in body and isinstance(body[field], int | None):
            body[field] = MAX_TOKENS
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS
    if isinstance(body.get("min_tokens"), int):
        body["min_tokens"] = min(body["min_tokens"], MAX_TOKENS)


def _send(case, base_url: str) -> httpx.Response:
    """Send ``case`` with httpx (schemathesis' own ``call`` goes through requests, which
    this environment's urllib3 replacement breaks)."""
    kw = case.as_transport_kwargs(base_url, {"Authorization": f"Bearer {KEY}"})
    body = kw.get("json", _NONE)
    if body is _NONE:
        content = kw.get("data")
    else:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.request(
        kw["method"],
        kw["url"],
        params=kw.get("params"),
        headers=kw.get("headers"),
        content=content,
        timeout=120,
    )


_NONE = object()


@pytest.mark.parametrize(
    ("method", "path", "mode"),
    [
        ("GET", "/health", GenerationMode.POSITIVE),
        ("GET", "/metrics", GenerationMode.POSITIVE),
        ("GET", "/v1/models", GenerationMode.POSITIVE),
        ("GET", "/steps", GenerationMode.POSITIVE),
        *(
            ("POST", path, mode)
            for path in BODIES
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
        ),
    ],
)
def test_no_generated_request_gets_a_5xx(
    api_schema, fault_server: LocalServer, method: str, path: str, mode: GenerationMode
):
    seen: list[int] = []

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
        _bounded(case.body)
        response = _send(case, fault_server.url)
        seen.append(response.status_code)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert isinstance(error["message"], str) and error["message"], response.text
            assert isinstance(error["type"], str), response.text

    check()
    assert seen  # the strategy generated requests, and they were sent
    if mode is GenerationMode.NEGATIVE:
        assert all(400 <= s < 500 for s in seen), seen
    fault_server.wait_idle()
