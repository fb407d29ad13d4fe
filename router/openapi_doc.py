"""The request bodies in the served OpenAPI document (``GET /openapi.json``).

The POST handlers read and validate their bodies themselves
(:meth:`router.ingress.Ingress._read_json`, then :func:`router.openai_format.validate`):
a bad body is then a 400 in OpenAI's format that names the field, not FastAPI's 422, and
the body is parsed once. So FastAPI sees no body parameter, and each such route declares
its body through ``openapi_extra`` instead (:meth:`ApiApp.add_body_route`): a required
``application/json`` body whose schema is the JSON schema of the pydantic model that
validates it, with that model's schemas (and those of the models it nests) under the
document's ``components``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

REF = "#/components/schemas/{model}"
"""Where a model's schema is in the document (pydantic's ``ref_template``)."""


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """The ``openapi_extra`` of a route whose JSON body ``model`` validates:
    ``{"requestBody": {"required": True, "content": {"application/json": {"schema":
    {"$ref": "#/components/schemas/<model's name>"}}}}}``."""
    ref = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def body_schemas(models: Iterable[type[BaseModel]]) -> dict[str, dict[str, Any]]:
    """The component schemas of ``models`` and of the models they nest, by model name:
    pydantic's JSON schema of what each validates, its references into
    ``#/components/schemas``.

    Raises:
        ValueError: two different schemas have one name.
    """
    out: dict[str, dict[str, Any]] = {}
    for model in models:
        schema = model.model_json_schema(ref_template=REF)
        for name, sub in [*schema.pop("$defs", {}).items(), (model.__name__, schema)]:
            if out.setdefault(name, sub) != sub:
                raise ValueError(f"two request body schemas are named {name!r}")
    return out


class ApiApp(FastAPI):
    """A FastAPI app whose document declares the bodies its handlers validate themselves.

    Its ``/openapi.json`` is FastAPI's document with the schemas of the models given to
    :meth:`add_body_route` added to ``components.schemas``.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.body_models: list[type[BaseModel]] = []
        """The models of the bodies declared so far (their schemas go into the document)."""

    def add_body_route(
        self, path: str, endpoint: Callable[..., Any], model: type[BaseModel]
    ) -> None:
        """Route ``POST path`` to ``endpoint``, which reads its JSON body and validates it
        with ``model``; the document declares that body as required."""
        self.add_api_route(path, endpoint, methods=["POST"], openapi_extra=request_body(model))
        self.body_models.append(model)

    def openapi(self) -> dict[str, Any]:
        """The document (built on first use, then kept), with the body models' schemas.

        Raises:
            ValueError: a body model's schema has the name of another component schema.
        """
        if self.openapi_schema is None:
            bodies = body_schemas(self.body_models)
            doc = super().openapi()  # kept as self.openapi_schema
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            if clash := sorted(n for n in bodies.keys() & schemas if bodies[n] != schemas[n]):
                self.openapi_schema = None
                raise ValueError(f"component schemas declared twice: {clash}")
            schemas.update(bodies)
        return self.openapi_schema
