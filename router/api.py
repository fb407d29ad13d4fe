"""The ingress as a Ray Serve deployment: :class:`router.ingress.Ingress` over the model
deployment's replicas (:class:`router.dispatch.RayReplicas`), routed by
:class:`router.request_router.LoadAwareRouter`.

The app is built when this module is imported, as ``serve.ingress`` needs it; Serve binds
the routes' ``self`` to the deployment's replica.
"""

import asyncio
import logging
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from router.dispatch import RayReplicas
from router.ingress import Ingress, add_routes, make_app
from router.scaling_store import read_decision

logger = logging.getLogger(__name__)

app = make_app()
add_routes(app, Ingress)


@serve.ingress(app)
class OpenAIIngress(Ingress):
    """The HTTP ingress deployment.

    With autoscaling, it relays each class's traffic to the autoscaler: every
    ``decision_period_s`` it sends :class:`router.scaling.ScalingSignals` to every model
    replica (Serve's controller reads only replicas' numbers), reads the autoscaler's last
    decision back (``/health``, ``iterserve:num_replicas_target``), and closes its step
    streams to replicas being scaled down once their last request ended, so that they
    stop then (:meth:`router.dispatch.RayReplicas.close_retired_streams`).

    Args:
        replicas: handle to the model-replica deployment.
        settings: :class:`router.settings.IngressSettings` fields.
    """

    def __init__(self, replicas: DeploymentHandle, settings: dict[str, Any]) -> None:
        self._ray = RayReplicas(replicas)
        super().__init__(self._ray, settings)
        self._relay: asyncio.Task | None = None
        if self.scaling is not None:
            # Serve runs the constructor on the replica's event loop.
            self._relay = asyncio.get_running_loop().create_task(self._relay_scaling())

    async def _relay_scaling(self) -> None:
        assert self.scaling is not None and self.settings.autoscaling is not None
        period = float(self.settings.autoscaling["decision_period_s"])
        handle = self._ray.handle
        while True:
            await asyncio.sleep(period)
            try:
                self._ray.close_retired_streams()
                await self._ray.send_scaling_signals(self.scaling.encode(), timeout_s=period)
                record = await asyncio.to_thread(
                    read_decision, handle.app_name, handle.deployment_name
                )
            except Exception as e:  # noqa: BLE001 - the next period tries again
                logger.warning("autoscaling relay: %s: %s", type(e).__name__, e)
                continue
            if record is not None:
                self.scaling_decision = record
                self.metrics.target_replicas = record.target

    async def drain(self, grace_s: float) -> int:
        """Stop taking requests, let the open ones finish for up to ``grace_s`` seconds,
        then end the rest with an error (:meth:`router.dispatch.RayReplicas.drain`); the
        number ended so. ``iterserve serve`` calls it on SIGINT or SIGTERM, before it
        stops Serve (which would otherwise cut the open streams mid-message)."""
        return await self._ray.drain(grace_s)

    async def __del__(self) -> None:
        """Serve calls it once this ingress has drained: its step streams close, so the
        model replicas, which count each as a request in flight, can stop at once."""
        if self._relay is not None:
            self._relay.cancel()
        self._ray.streams.close_all()
