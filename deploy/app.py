"""build_app(config): the Ray Serve application (ingress + model replicas)."""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from deploy.autoscale import ServePolicy
from deploy.config import ServiceConfig
from deploy.replica import ModelReplica
from policies.autoscale import AutoscalingSettings
from router.api import OpenAIIngress
from router.request_router import LoadAwareRouter

APP_NAME = "iterserve"
INGRESS_NAME = "OpenAIIngress"
REPLICA_NAME = "ModelReplica"
DRAIN_S = 5.0
"""Seconds a stopping model replica has to finish its requests before Serve kills it, with
a fixed fleet (Ctrl-C, a redeploy); requests cut then fail."""
SCALE_DOWN_DRAIN_S = 300.0
"""The same with autoscaling, where replicas stop under traffic: a replica scaled down
gets this long to finish the requests it holds (it stops when they end: the ingress
closes its streams to it then), so that none is cut short."""


def build_app(config: ServiceConfig) -> serve.Application:
    """The application: ``OpenAIIngress`` (FastAPI) bound to ``num_replicas`` ``ModelReplica``s,
    or, with ``config.autoscaling``, as many as :class:`deploy.autoscale.ServePolicy` asks
    for (:func:`autoscaling_config`).

    Each replica reserves ``replica_num_cpus`` CPUs (torch uses that many threads) and
    ``replica_num_gpus`` GPUs. Serve checks each replica's health every
    ``health_check_period_s`` (``ModelReplica.check_health``: its engine is alive and not
    stalled past ``replica_stall_timeout_s``), giving it ``health_check_timeout_s`` to
    answer. Replicas publish their load snapshot every
    ``routing_stats_period_s`` seconds; :class:`router.request_router.LoadAwareRouter` routes
    on it and the ingress admits on it. The ingress reserves no CPU: it only waits on I/O.
    """
    engine = config.engine_config()
    # Serve's router arguments must be JSON: the classes travel as their fields and the
    # policy as name and options, rebuilt by policies.make_classes/policy_from_spec.
    classes = {name: asdict(c) for name, c in config.traffic_classes().items()}
    policy = engine.policy_spec()
    actor_options: dict[str, Any] = {"num_cpus": config.replica_num_cpus}
    if config.replica_num_gpus:
        actor_options["num_gpus"] = config.replica_num_gpus
    router_config = RequestRouterConfig(
        request_router_class=LoadAwareRouter,
        request_router_kwargs={"traffic_classes": classes, "policy": policy},
        request_routing_stats_period_s=config.routing_stats_period_s,
        request_routing_stats_timeout_s=max(5.0, 10 * config.routing_stats_period_s),
    )
    scaling = config.autoscaling_settings()
    if scaling is None:
        count: dict[str, Any] = {"num_replicas": config.num_replicas}
    else:
        count = {"autoscaling_config": autoscaling_config(scaling, classes)}
    drain_s = DRAIN_S if scaling is None else SCALE_DOWN_DRAIN_S
    replica = (
        serve.deployment(ModelReplica, name=REPLICA_NAME)
        .options(
            **count,
            max_ongoing_requests=config.max_ongoing_requests,
            ray_actor_options=actor_options,
            request_router_config=router_config,
            health_check_period_s=config.health_check_period_s,
            health_check_timeout_s=config.health_check_timeout_s,
            graceful_shutdown_timeout_s=drain_s,
        )
        # The twin's model travels with the arguments: its file need not be on every node.
        .bind(
            engine.model_dump(),
            max(1, math.floor(config.replica_num_cpus)),
            config.twin_cost(),
            config.replica_stall_timeout_s,
        )
    )
    ingress = serve.deployment(OpenAIIngress, name=INGRESS_NAME).options(
        num_replicas=1,
        max_ongoing_requests=100_000,  # it holds requests for admission; replicas cap work
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(replica, config.ingress_settings().model_dump())


def autoscaling_config(
    settings: AutoscalingSettings, classes: dict[str, dict[str, Any]]
) -> AutoscalingConfig:
    """Ray Serve's autoscaling config for the model deployment: our policy
    (:class:`deploy.autoscale.ServePolicy`) within the settings' bounds, and none of
    Serve's own damping.

    Serve's delays are 0, so the policy's own (its ``upscale_delay_s``, hysteresis and
    cooldown) are the only ones.
    Replicas record and push their numbers every ``decision_period_s``
    (``metrics_interval_s``), so each decision reads counts at most a few periods old;
    Serve keeps them ``look_back_period_s``, which must exceed that interval.
    """
    period = settings.decision_period_s
    with warnings.catch_warnings():
        # metrics_interval_s is deprecated in favour of environment variables that Ray
        # 2.60 does not read yet; it is the only way to push faster than every 10 s.
        warnings.simplefilter("ignore", DeprecationWarning)
        return AutoscalingConfig(
            min_replicas=settings.min_replicas,
            initial_replicas=settings.min_replicas,
            max_replicas=settings.max_replicas,
            upscale_delay_s=0.0,
            downscale_delay_s=0.0,
            metrics_interval_s=period,
            look_back_period_s=max(settings.window_s, 2 * period),
            policy=AutoscalingPolicy(
                policy_function=f"{ServePolicy.__module__}:{ServePolicy.__name__}",
                policy_kwargs={"settings": settings.model_dump(), "traffic_classes": classes},
            ),
        )


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Entry point for ``serve run`` / ``serve deploy`` (``import_path: deploy.app:app_builder``).

    ``args`` are :class:`ServiceConfig` fields (the config file's ``args:`` section).
    """
    return build_app(ServiceConfig(**args))


__all__ = [
    "APP_NAME",
    "INGRESS_NAME",
    "REPLICA_NAME",
    "app_builder",
    "autoscaling_config",
    "build_app",
]
