"""The ingress as a Ray Serve deployment: :class:`router.ingress.Ingress` over the model
deployment's replicas (:class:`router.dispatch.RayReplicas`), routed by
:class:`router.request_router.LoadAwareRouter`.

The app is built when this module is imported, as ``serve.ingress`` needs it; Serve binds
the routes' ``self`` to the deployment's replica.
"""

from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from router.dispatch import RayReplicas
from router.ingress import Ingress, add_routes, make_app

app = make_app()
add_routes(app, Ingress)


@serve.ingress(app)
class OpenAIIngress(Ingress):
    """The HTTP ingress deployment.

    Args:
        replicas: handle to the model-replica deployment.
        settings: :class:`router.settings.IngressSettings` fields.
    """

    def __init__(self, replicas: DeploymentHandle, settings: dict[str, Any]) -> None:
        super().__init__(RayReplicas(replicas), settings)
