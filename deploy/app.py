"""build_app(config): the Ray Serve application (ingress + model replicas)."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from deploy.config import ServiceConfig
from deploy.replica import ModelReplica
from router.api import OpenAIIngress
from router.request_router import LoadAwareRouter

APP_NAME = "iterserve"
INGRESS_NAME = "OpenAIIngress"
REPLICA_NAME = "ModelReplica"


def build_app(config: ServiceConfig) -> serve.Application:
    """The application: ``OpenAIIngress`` (FastAPI) bound to ``num_replicas`` ``ModelReplica``s.

    Each replica reserves ``replica_num_cpus`` CPUs (torch uses that many threads) and
    ``replica_num_gpus`` GPUs. Replicas publish their load snapshot every
    ``routing_stats_period_s`` seconds; :class:`router.request_router.LoadAwareRouter` routes
    on it and the ingress admits on it. The ingress reserves no CPU: it only waits on I/O.
    """
    engine = config.engine_config()
    # Serve's router arguments must be JSON: the classes travel as their fields and the
    # policy as name and options, rebuilt by policies.classes_from_fields/policy_from_spec.
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
    replica = (
        serve.deployment(ModelReplica, name=REPLICA_NAME)
        .options(
            num_replicas=config.num_replicas,
            max_ongoing_requests=config.max_ongoing_requests,
            ray_actor_options=actor_options,
            request_router_config=router_config,
            health_check_period_s=2.0,
            health_check_timeout_s=30.0,
            graceful_shutdown_timeout_s=5.0,
        )
        # The twin's model travels with the arguments: its file need not be on every node.
        .bind(
            engine.model_dump(),
            max(1, math.floor(config.replica_num_cpus)),
            config.twin_cost(),
        )
    )
    ingress = serve.deployment(OpenAIIngress, name=INGRESS_NAME).options(
        num_replicas=1,
        max_ongoing_requests=100_000,  # it holds requests for admission; replicas cap work
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(replica, config.ingress_settings().model_dump())


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Entry point for ``serve run`` / ``serve deploy`` (``import_path: deploy.app:app_builder``).

    ``args`` are :class:`ServiceConfig` fields (the config file's ``args:`` section).
    """
    return build_app(ServiceConfig(**args))


__all__ = ["APP_NAME", "INGRESS_NAME", "REPLICA_NAME", "app_builder", "build_app"]
