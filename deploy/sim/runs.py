"""One simulated run, and the service config with fields replaced: what ``iterserve
simulate`` (:mod:`deploy.sim.cli`) and its search and ablation (:mod:`deploy.sim.search`)
both run."""

from __future__ import annotations

from typing import Any

from deploy.config import ServiceConfig
from deploy.sim.fleet import Autoscaling, Fleet, SimRun
from deploy.sim.report import summarize
from deploy.sim.trace import TraceSpec, load_requests
from engine.core.step_cost import CostModel


def with_engine(
    config: ServiceConfig, top: dict[str, Any] | None = None, **engine: Any
) -> ServiceConfig:
    """``config`` with engine fields and top-level fields replaced, validated again.

    Raises:
        pydantic.ValidationError: a bad value.
    """
    data = config.model_dump(exclude={"engine": {"model"}}) | (top or {})
    data["engine"] = data["engine"] | engine
    return ServiceConfig(**data)


def simulate(
    config: ServiceConfig,
    cost: CostModel,
    spec: TraceSpec,
    routing: str,
    seed: int,
    autoscaling: Autoscaling | None = None,
) -> tuple[SimRun, dict[str, Any]]:
    """One run: ``(run, summary)`` (:func:`deploy.sim.report.summarize`; with
    ``autoscaling``, also ``replica_hours`` and ``decisions``)."""
    fleet = Fleet(config, cost, routing=routing, seed=seed, autoscaling=autoscaling)
    run = fleet.run(load_requests(spec))
    summary = summarize(run, config.traffic_classes())
    if autoscaling is not None:
        summary["replica_hours"] = run.replica_s / 3600
        summary["decisions"] = [[d.t, d.target, d.reason] for d in run.decisions]
    return run, summary
