"""``iterserve serve`` with one replica on this machine: the engine in the server's process.

No Ray: uvicorn serves :class:`router.ingress.Ingress` over a
:class:`deploy.engine_replica.EngineReplica` in this process, whose engine thread steps
while the event loop streams. The API, admission, classes, keys and ``/metrics`` are the
Ray Serve application's (the same :class:`router.ingress.Ingress`); only the replica hop
is gone, and with it Ray's processes (the ingress, Serve's controller, Ray's own), which
preempt torch's threads on a few cores. The served cost per token over the engine offline
is measured by ``python -m bench.peers`` (``bench/results/peers.md``).

Several replicas, or a cluster (``--address``), take Ray Serve (:mod:`deploy.server`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import os
import signal
import socket
from collections.abc import Callable, Iterator

import uvicorn
import uvloop

from deploy.config import ServiceConfig
from deploy.engine_replica import EngineReplica
from engine.core.params import LoRARequest
from router.ingress import Ingress, add_routes, make_app
from router.local import LocalReplicas
from router.tools import ChatTemplates

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5.0
"""Seconds open requests get to finish after Ctrl-C; then the engine stops, and each
stream still open ends with an error event and ``data: [DONE]``."""
CUT_MARGIN_S = 5.0
"""Seconds after that before uvicorn cancels what is still running (a backstop: the
streams end as soon as the engine stops)."""
REPLICA_ID = "local"


class PortInUse(RuntimeError):
    """The server's port is taken."""


def bindable(host: str, port: int, reuse_addr: bool = True) -> bool:
    """Whether a listening socket could bind ``host:port`` now. Without ``reuse_addr``
    (as Ray Serve's direct ingress binds), the closed connections of a server that just
    stopped (TIME_WAIT, up to 60 s on Linux) block the port too."""
    with socket.socket() as s:
        if reuse_addr:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            return False
    return True


def check_port(host: str, port: int) -> None:
    """Fail before the model loads if ``host:port`` cannot be bound.

    Raises:
        PortInUse: another process listens there.
    """
    if not bindable(host, port):
        raise PortInUse(f"port {port} on {host} is in use (choose another with --port)")


class _Server(uvicorn.Server):
    """uvicorn's server, stopped by SIGINT or SIGTERM through the event loop.

    uvicorn's own handlers raise the signal again once it has shut down, which would
    cancel the engine's shutdown and end the process with a traceback. ``exiting`` is set
    on the first signal.
    """

    exiting: asyncio.Event

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        self.exiting = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        self.exiting.set()


def build_local(config: ServiceConfig) -> tuple[_Server, EngineReplica]:
    """The server (not yet started) and its replica, once the model has loaded."""
    threads = max(1, math.floor(config.replica_num_cpus))
    replica = EngineReplica(
        config.engine_config().model_dump(),
        threads,
        REPLICA_ID,
        step_log=config.step_log,
        step_history=config.step_history,
        service=config.model_dump(mode="json", exclude={"api_keys", "api_keys_file"}),
        twin_cost=config.twin_cost(),
    )
    for name, path in config.lora_adapters.items():
        # Refuse to start on an adapter that cannot be served, as vllm serve does.
        replica.engine.engine.add_lora(LoRARequest(name, path))
    ingress = Ingress(
        LocalReplicas(replica),
        config.ingress_settings().model_dump(),
        watch_disconnects=True,
        step_log=replica.recorder,
    )
    app = make_app()
    add_routes(app, ingress)
    server = _Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S + CUT_MARGIN_S,
        )
    )
    return server, replica


async def serve_until_stopped(server: _Server, replica: EngineReplica, banner: str) -> int:
    """Serve until SIGINT or SIGTERM; print ``banner`` once the port accepts
    connections. Returns the exit status."""
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        print(banner, flush=True)
    stopper = asyncio.create_task(_stop_engine_after_grace(server, replica))
    try:
        await task
    except SystemExit as e:  # uvicorn exits when it cannot bind
        return int(e.code or 1)
    finally:
        stopper.cancel()
        await replica.engine.shutdown()
    if server.started:
        print("iterserve: shut down", flush=True)
    return 0 if server.started else 1


async def _stop_engine_after_grace(server: _Server, replica: EngineReplica) -> None:
    """Once a signal asked the server to exit, give open requests
    :data:`GRACEFUL_SHUTDOWN_S`, then stop the engine: the requests still open then end
    with an error (503 ``replica_lost``; a stream, an error event and ``[DONE]``) rather
    than being cancelled mid-write by uvicorn."""
    await server.exiting.wait()
    await asyncio.sleep(GRACEFUL_SHUTDOWN_S)
    await replica.engine.shutdown()


def run_local(config: ServiceConfig, banner: Callable[[str | None, str], str]) -> int:
    """Load the model, then serve ``config`` in this process (see the module docstring);
    ``banner(weights, tool template)`` is what to print once it accepts requests.

    Raises:
        PortInUse: ``config.port`` is taken (checked before the model loads).
    """
    check_port(config.host, config.port)
    server, replica = build_local(config)
    logger.info("serving in this process (pid %d), without Ray", os.getpid())
    weights = replica.engine.engine.weights
    templates = ChatTemplates.of(replica.engine.engine.tokenizer, config.chat_template)
    ready = banner(None if weights is None else weights.describe(), templates.describe())
    # uvloop, which `uvicorn.run` and vLLM's API server pick too: its event loop spends less
    # CPU per streamed chunk than asyncio's, CPU that the engine's threads share.
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(serve_until_stopped(server, replica, ready))
