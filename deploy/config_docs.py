"""Write the configuration reference, ``docs/configuration.md``, from the models themselves.

Every key of the service YAML (``iterserve serve --config``, ``iterserve batch run
--config``, ``iterserve simulate --config`` and the Helm chart's ``config:`` value) is a
field of :class:`deploy.config.ServiceConfig` (which inherits the ingress's own fields from
:class:`router.settings.IngressOptions`), of :class:`deploy.config.AutoscalingConfig` under
``autoscaling:``, of :class:`engine.EngineConfig` under ``engine:``, of
:class:`router.tenants.ApiKeyConfig` under ``api_keys:``, or of :class:`policies.TrafficClass`
under ``engine.traffic_classes:``. Each row's type, default and constraints come from the
field; its meaning from the pydantic ``description``, or for a dataclass from the
attribute's docstring.

Usage::

    python -m deploy.config_docs > docs/configuration.md   # regenerate
    python -m deploy.config_docs --check docs/configuration.md   # exit 1 when stale

``tests/test_config_docs.py`` fails when the committed file differs from :func:`render`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from deploy.config import SERVER_ENGINE_DEFAULTS, AutoscalingConfig, ServiceConfig
from engine.config import EngineConfig
from engine.llm import OFFLINE_DEFAULTS
from policies import DEFAULT_CLASS, DEFAULT_CLASSES, TrafficClass
from router.settings import IngressOptions
from router.tenants import ApiKeyConfig

Row = tuple[str, str, str, str]
"""(key, type, default, meaning) of one table row, as Markdown."""

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", Any: "any"}

ALSO_ACCEPTED: dict[tuple[type[BaseModel], str], Any] = {(ServiceConfig, "num_replicas"): "auto"}
"""Values a field takes besides its annotation's, by (model, field): ServiceConfig's
before-validator reads ``num_replicas: auto`` as an autoscaling section, so the field
itself stays an integer."""


def type_name(tp: Any) -> str:
    """A reader's name for a field's annotation: ``integer or null``, ``"a" or "b"``."""
    if tp is type(None):
        return "null"
    if tp in _SCALARS:
        return _SCALARS[tp]
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return " or ".join(f"`{json.dumps(a)}`" for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"mapping ({type_name(args[0])} to {type_name(args[1])})"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _constraints(metadata: list[Any]) -> str:
    rules = []
    for m in metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if isinstance(m, getattr(annotated_types, attr.capitalize())):
                rules.append(f"{op} {getattr(m, attr)}")
    return ", ".join(rules)


def _value(v: Any) -> str:
    """A default as it is written in YAML/JSON, in a code span."""
    if isinstance(v, BaseModel):
        v = v.model_dump()
    return f"`{json.dumps(v)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("``", "`").replace("|", "\\|")


def attribute_docstrings(cls: type) -> dict[str, str]:
    """``{attribute: docstring}`` of a class whose attributes are documented by the string
    literal that follows them (the convention of this project's dataclasses)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source: a class built at run time
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for stmt, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def model_rows(
    model: type[BaseModel],
    prefix: str = "",
    only: set[str] | None = None,
    skip: set[str] = frozenset(),
    defaults: dict[str, Any] | None = None,
) -> Iterator[Row]:
    """One row per field of a pydantic model, keyed ``prefix + name``.

    Args:
        only: fields to include (default: all); ``skip``: fields to leave out.
        defaults: values that override the field's own default in the row, shown beside it
            (the server's engine settings).

    Raises:
        ValueError: a field has no description and no attribute docstring.
    """
    docs = attribute_docstrings(model)
    for name, field in model.model_fields.items():
        if (only is not None and name not in only) or name in skip:
            continue
        yield (
            f"`{prefix}{name}`",
            _field_type(field) + _also(model, name),
            _field_default(field, (defaults or {}).get(name, PydanticUndefined)),
            _meaning(model, name, field.description or docs.get(name)),
        )


def _field_type(field: FieldInfo) -> str:
    rules = _constraints(field.metadata)
    return type_name(field.annotation) + (f", {rules}" if rules else "")


def _also(model: type[BaseModel], name: str) -> str:
    also = ALSO_ACCEPTED.get((model, name), PydanticUndefined)
    return "" if also is PydanticUndefined else f"; or {_value(also)}"


def _field_default(field: FieldInfo, override: Any) -> str:
    if field.is_required():
        return "required"
    if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
        return "see below"
    default = field.get_default(call_default_factory=True)
    text = _value(default)
    if override is not PydanticUndefined and override != default:
        text += f" (`iterserve serve`: {_value(override)})"
    return text


def _meaning(owner: type, name: str, text: str | None) -> str:
    if not text:
        raise ValueError(f"{owner.__name__}.{name} has no description: add one in the model")
    return _cell(text)


def traffic_class_rows(prefix: str) -> Iterator[Row]:
    """One row per settable field of the :class:`policies.TrafficClass` dataclass (``name``
    is the mapping's key)."""
    docs = attribute_docstrings(TrafficClass)
    for f in dataclasses.fields(TrafficClass):
        if f.name == "name":
            continue
        if f.default is not dataclasses.MISSING:
            default = f"the class's (below); a new class: {_value(f.default)}"
        else:
            default = "the class's (below); required for a new class"
        rules = {"ttft_slo_s": "> 0", "tpot_slo_s": "> 0", "max_queue_wait_s": ">= 0"}
        kind = type_name(f.type if not isinstance(f.type, str) else _resolve(f.type))
        kind += f", {rules[f.name]}" if f.name in rules else ""
        kind += ", >= 1" if f.name == "hard_queue_cap" else ""
        yield f"`{prefix}{f.name}`", kind, default, _meaning(TrafficClass, f.name, docs.get(f.name))


def _resolve(annotation: str) -> Any:
    return eval(annotation, vars(sys.modules[TrafficClass.__module__]))  # noqa: S307


def table(rows: list[Row]) -> str:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [f"| {k} | {t} | {d} | {m} |" for k, t, d, m in rows]
    return "\n".join(lines)


def default_classes_table() -> str:
    lines = [
        "| class | `ttft_slo_s` | `tpot_slo_s` | `default_priority` | `max_queue_wait_s` "
        "| `hard_queue_cap` | `rejectable` |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, c in DEFAULT_CLASSES.items():
        lines.append(
            f"| `{name}` | {c.ttft_slo_s} | {c.tpot_slo_s} | {c.default_priority} "
            f"| {c.max_queue_wait_s} | {_value(c.hard_queue_cap)} | {_value(c.rejectable)} |"
        )
    return "\n".join(lines)


def render() -> str:
    """The whole of ``docs/configuration.md``."""
    ingress = set(IngressOptions.model_fields)
    offline = ", ".join(f"`{k}: {v}`" for k, v in OFFLINE_DEFAULTS.items())
    parts = [
        "# Configuration",
        "<!-- Generated by `python -m deploy.config_docs > docs/configuration.md`; "
        "do not edit by hand. -->",
        "One YAML file configures a service. `iterserve serve --config service.yaml` reads it, "
        "and so do `iterserve batch run --config` (the model, replica and engine keys), "
        "`iterserve simulate --config`, and the Helm chart, whose `config:` value is this file "
        "(`helm/iterserve/values.schema.json` is generated from the same model: "
        "`python -m deploy.chart_schema`). Command-line flags override the file. An unknown key "
        "or a value out of range stops the command before anything starts, with the key named.",
        "```yaml\n"
        "num_replicas: 2\n"
        "engine:\n"
        "  max_num_batched_tokens: 1024\n"
        "  traffic_classes:\n"
        "    interactive: {ttft_slo_s: 1.0, tpot_slo_s: 0.1}\n"
        "api_keys:\n"
        "  sk-team-a: {tenant: team-a, traffic_class: interactive}\n"
        "```",
        "## Service",
        "Top-level keys (`deploy.config.ServiceConfig`).",
        table(list(model_rows(ServiceConfig, skip=ingress))),
        "### `autoscaling`",
        "The SLO autoscaler's bounds and settings (`deploy.config.AutoscalingConfig`; the "
        "policy: `policies.autoscale`). With this section the replicas run on Ray Serve, "
        "their count starts at `min_replicas`, and `replica_num_cpus` defaults to 1. "
        "`num_replicas: auto` (or `iterserve serve --num-replicas auto`) turns it on with "
        "the defaults where the section is absent; a number of replicas beside the section "
        "is refused. `max_replicas` must be at least `min_replicas`, and `window_s` at least "
        "`decision_period_s`. The Helm chart needs `max_replicas`: it is the worker group's "
        "`maxReplicas`, and a host's CPUs mean nothing there.",
        "```yaml\n"
        "autoscaling:\n"
        "  min_replicas: 1\n"
        "  max_replicas: 4\n"
        "  scale_down_delay_s: 300\n"
        "replica_num_cpus: 4\n"
        "```",
        table(list(model_rows(AutoscalingConfig, prefix="autoscaling."))),
        "## Ingress",
        "Top-level keys the ingress reads (`router.settings.IngressOptions`, which "
        "`ServiceConfig` inherits).",
        table(list(model_rows(IngressOptions))),
        "### `api_keys`",
        "A mapping of API key to what the key may do (`router.tenants.ApiKeyConfig`). "
        "The same form is used by `api_keys_file`.",
        table(list(model_rows(ApiKeyConfig, prefix="api_keys.KEY."))),
        "## Engine",
        "Keys under `engine:` (`engine.config.EngineConfig`; `model` is set at the top level). "
        "The defaults are the engine's. `iterserve serve` differs where the default column "
        "says so; a partial `engine:` section changes only the keys it names. Offline work "
        f"(`engine.LLM`, `iterserve batch run`) defaults to {offline}.",
        table(
            list(
                model_rows(
                    EngineConfig, prefix="engine.", skip={"model"}, defaults=SERVER_ENGINE_DEFAULTS
                )
            )
        ),
        "### `engine.traffic_classes`",
        "A mapping of class name to the fields to change (`policies.TrafficClass`). A known "
        "class keeps the fields not given; a new class needs every field without a default. "
        f"A request that names no class is `{DEFAULT_CLASS}`.",
        table(list(traffic_class_rows("engine.traffic_classes.NAME."))),
        "The built-in classes (`policies.DEFAULT_CLASSES`):",
        default_classes_table(),
    ]
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.config_docs", description=__doc__)
    p.add_argument("--check", metavar="PATH", help="exit 1 if PATH differs from the output")
    args = p.parse_args(argv)
    text = render()
    if args.check is None:
        sys.stdout.write(text)
        return 0
    if Path(args.check).read_text() != text:
        print(f"{args.check} is stale: run python -m deploy.config_docs > {args.check}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
