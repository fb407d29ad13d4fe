"""CORS for browser clients, with the origins of the service config (``allowed_origins``).

The FastAPI app is built when ``router.api`` is imported, before the ingress replica knows
its settings, so the middleware reads the origins when it first handles a request.
"""

from __future__ import annotations

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send


class ConfiguredCORS:
    """Starlette's ``CORSMiddleware`` over :attr:`origins` (``["*"]``: any, as vLLM's
    default), all methods and headers (``Authorization`` included), no credentials."""

    origins: list[str] = ["*"]

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._cors: CORSMiddleware | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._cors is None:
            self._cors = CORSMiddleware(
                self.app, allow_origins=list(self.origins), allow_methods=["*"], allow_headers=["*"]
            )
        await self._cors(scope, receive, send)
