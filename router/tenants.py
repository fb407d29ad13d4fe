"""API keys to tenants: who may ask for which traffic class and priority.

A key maps to a tenant, a traffic class and a priority ceiling (the most urgent priority,
i.e. the lowest number, its requests may carry). A request may lower its urgency, with
the ``priority`` field or the ``x-iterserve-class`` header, never raise it. With no keys
configured no key is needed and every request is ``standard``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from policies import DEFAULT_CLASS, TrafficClass
from router.errors import ApiError

CLASS_HEADER = "x-iterserve-class"


class ApiKeyConfig(BaseModel):
    """What one API key may do."""

    model_config = ConfigDict(extra="forbid")

    tenant: str = Field(description="who the key belongs to; never a metric label")
    traffic_class: str = Field(
        DEFAULT_CLASS,
        description="the class of its requests; a request may ask for a less urgent one",
    )
    max_priority: int | None = Field(
        None,
        description="the most urgent priority (lowest number) its requests may carry; "
        "None: its class's default priority",
    )
    adapters: list[str] | None = Field(
        None,
        description="the LoRA adapters its requests may name as `model` (the base model "
        "always); None: every adapter",
    )
    admin: bool = Field(
        False, description="may load and unload LoRA adapters (allow_runtime_lora_updates)"
    )


def check_key_classes(
    api_keys: Mapping[str, ApiKeyConfig], classes: Mapping[str, TrafficClass]
) -> None:
    """Raises:
    ValueError: a key names a traffic class that is not in ``classes``.
    """
    for k in api_keys.values():
        if k.traffic_class not in classes:
            raise ValueError(
                f"api key of tenant {k.tenant!r}: unknown traffic_class "
                f"{k.traffic_class!r}; known: {sorted(classes)}"
            )


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request and how it is scheduled."""

    tenant: str | None
    traffic_class: str
    priority: int
    adapters: frozenset[str] | None = None
    """The LoRA adapters its key may use; None: every one."""


def authenticate(
    api_keys: Mapping[str, ApiKeyConfig], authorization: str | None
) -> ApiKeyConfig | None:
    """The caller's key, from the ``Authorization`` header (``Bearer <key>``, the scheme
    in any case, as RFC 9110 allows); None when no keys are configured.

    Raises:
        ApiError: 401 for a missing or unknown key (when keys are configured).
    """
    if not api_keys:
        return None
    header = (authorization or "").strip()
    scheme, _, rest = header.partition(" ")
    key = rest.strip() if scheme.lower() == "bearer" else header
    if not key:
        raise ApiError(
            401, "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key"
        )
    entry = api_keys.get(key)
    if entry is None:
        raise ApiError(401, "invalid API key", code="invalid_api_key")
    return entry


def resolve_caller(
    api_keys: Mapping[str, ApiKeyConfig],
    classes: Mapping[str, TrafficClass],
    authorization: str | None,
    class_header: str | None,
    priority: int | None,
) -> Caller:
    """The caller's tenant, class and priority for one request.

    Args:
        authorization: the ``Authorization`` header, if sent (see :func:`authenticate`).
        class_header: the ``x-iterserve-class`` header, if sent.
        priority: the body's ``priority`` field, if sent.

    Raises:
        ApiError: 401 for a missing or unknown key (when keys are configured); 400 for an
            unknown class; 403 for a class or priority more urgent than the key allows.
    """
    entry = authenticate(api_keys, authorization)
    if entry is not None:
        tenant, base, ceiling = entry.tenant, entry.traffic_class, entry.max_priority
    else:
        tenant, base, ceiling = None, DEFAULT_CLASS, None
    if ceiling is None:
        ceiling = classes[base].default_priority
    name = base
    if class_header:
        name = class_header.strip()
        if name not in classes:
            raise ApiError(
                400,
                f"unknown traffic class {name!r} in {CLASS_HEADER}; known: {sorted(classes)}",
                param=CLASS_HEADER,
                code="invalid_value",
            )
        if classes[name].default_priority < ceiling:
            raise ApiError(
                403,
                f"traffic class {name!r} (priority "
                f"{classes[name].default_priority}) is more urgent than this "
                f"key allows (priority {ceiling} at most urgent)",
                param=CLASS_HEADER,
                code="priority_not_allowed",
            )
    effective = classes[name].default_priority if priority is None else priority
    if effective < ceiling:
        raise ApiError(
            403,
            f"priority {effective} is more urgent than this key allows "
            f"({ceiling}; lower numbers are more urgent)",
            param="priority",
            code="priority_not_allowed",
        )
    adapters = None if entry is None or entry.adapters is None else frozenset(entry.adapters)
    return Caller(tenant, name, effective, adapters)


def check_adapter(caller: Caller, adapter: str) -> None:
    """Raises:
    ApiError: 403 when ``caller``'s key may not use LoRA adapter ``adapter``.
    """
    if caller.adapters is not None and adapter not in caller.adapters:
        raise ApiError(
            403,
            f"this API key may not use adapter {adapter!r}; it may use the base model"
            + (f" and {sorted(caller.adapters)}" if caller.adapters else ""),
            param="model",
            code="model_not_allowed",
        )


def check_admin(api_keys: Mapping[str, ApiKeyConfig], authorization: str | None) -> None:
    """Raises:
    ApiError: 401 as :func:`authenticate`; 403 when keys are configured and the caller's
        is not ``admin``.
    """
    entry = authenticate(api_keys, authorization)
    if entry is not None and not entry.admin:
        raise ApiError(
            403, "loading and unloading adapters needs an admin API key", code="not_admin"
        )
