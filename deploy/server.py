"""``iterserve serve``: one replica in this process, or Ray Serve; serve until a signal.

One replica on this machine (no ``--address``, no ``RAY_ADDRESS``, ``num_replicas`` 1)
runs in this process without Ray (:mod:`deploy.local_server`), as ``vllm serve`` does.
Otherwise: start an embedded Ray cluster (``--num-replicas`` above 1, or
``--address local``) or join one (``--address``), deploy the application, wait.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback

import ray
from ray import serve

from deploy.app import APP_NAME, build_app
from deploy.config import ServiceConfig
from router.tenants import check_key_classes

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 20.0
DRAIN_MARGIN_S = 5.0
"""Seconds past the drain's grace that the server waits for the ingress to answer."""
PORT_RELEASE_S = 65.0
"""Longest wait for a just-stopped server's connections on the port (TIME_WAIT is 60 s)."""

SERVE_ENV_DEFAULTS = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
}
"""Set (unless already set) for the embedded cluster, whose processes inherit them.

- Serve's controller wakes every 0.1 s by default; on a few cores each wake-up preempts
  one of torch's OpenMP threads, and the whole step waits for it (docs/operations.md).
- Serve's throughput-optimized mode (user code on the replica's own event loop, gRPC
  between Serve's processes, the ingress replica serving HTTP itself, GC frozen after
  start-up) costs fewer CPU cycles per streamed token.
"""


def embedded_serve_env(config: ServiceConfig) -> dict[str, str]:
    """Environment for an embedded cluster's processes (set before ``ray.init``).

    Besides :data:`SERVE_ENV_DEFAULTS`: the ingress replica itself listens on
    ``config.port`` (Serve's direct ingress, whose port range is pinned to that one
    port), so a request takes one process hop less than through Serve's HTTP proxy, which
    then listens on a spare port (:func:`deploy`'s ``proxy_port``).
    """
    return {
        **{k: os.environ.get(k, v) for k, v in SERVE_ENV_DEFAULTS.items()},
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(config.port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(config.port + 1),
        # Serve holds a stopping direct-ingress replica for 30 s so that an external
        # load balancer can deregister it; a single embedded node has none, and
        # Ctrl-C would otherwise wait out SHUTDOWN_TIMEOUT_S.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    }


def spare_port(host: str) -> int:
    """A TCP port free on ``host`` now (for Serve's proxy when the ingress serves directly)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServeError(RuntimeError):
    """The server cannot start; the message says why and what to do."""


def start_ray(address: str | None, config: ServiceConfig) -> None:
    """Join ``address``, or start an embedded single-machine Ray (``address`` None or
    ``"local"``) with the dashboard off and :func:`embedded_serve_env` set.

    Ray 2.60 turns on token authentication for new local clusters: ``ray.init`` writes
    a token to ``~/.ray/auth_token`` and this process uses it. Other clients of that
    cluster (``ray job submit``, ``serve deploy``) need ``RAY_AUTH_MODE=token`` to send
    it. Joining a cluster with authentication needs its token the same way.

    Raises:
        ServeError: the cluster cannot be reached or refuses our token.
    """
    try:
        if address and address != "local":
            ray.init(address=address, logging_level=logging.WARNING)
        else:
            os.environ.update(embedded_serve_env(config))
            ray.init(include_dashboard=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError) as e:
        hint = ""
        if "auth" in str(e).lower() or "token" in str(e).lower():
            hint = (
                " The cluster uses token authentication: set RAY_AUTH_MODE=token and "
                "put its token in ~/.ray/auth_token or RAY_AUTH_TOKEN."
            )
        raise ServeError(f"cannot start or join Ray ({address or 'local'}): {e}.{hint}") from e


def check_resources(config: ServiceConfig) -> str | None:
    """Fail fast when the replicas cannot all be placed (Ray would wait forever); with
    autoscaling, the replicas it starts with (``min_replicas``) must fit.

    Returns:
        A warning when autoscaling's ``max_replicas`` do not fit the cluster as it is now
        (the fleet stops growing where they stop fitting, unless the cluster grows:
        a Ray autoscaler adds nodes); else None.

    Raises:
        ServeError: not enough CPUs or GPUs in the cluster.
    """
    total = ray.cluster_resources()
    cpus, gpus = total.get("CPU", 0), total.get("GPU", 0)

    def fits(n: int) -> bool:
        return n * config.replica_num_cpus <= cpus and n * config.replica_num_gpus <= gpus

    need_cpu = config.num_replicas * config.replica_num_cpus
    need_gpu = config.num_replicas * config.replica_num_gpus
    if not fits(config.num_replicas):
        raise ServeError(
            f"{config.num_replicas} replicas need {need_cpu:g} CPUs and {need_gpu:g} GPUs; "
            f"the cluster has {cpus:g} CPUs and {gpus:g} GPUs "
            "(lower --num-replicas or replica_num_cpus)"
            + (" (autoscaling.min_replicas)" if config.autoscaling else "")
        )
    scaling = config.autoscaling_settings()
    if scaling is None or fits(scaling.max_replicas):
        return None
    fit = config.num_replicas
    while fits(fit + 1):
        fit += 1
    return (
        f"autoscaling.max_replicas={scaling.max_replicas} replicas need "
        f"{scaling.max_replicas * config.replica_num_cpus:g} CPUs and "
        f"{scaling.max_replicas * config.replica_num_gpus:g} GPUs; the cluster has "
        f"{cpus:g} CPUs and {gpus:g} GPUs now: the fleet stops at {fit} replicas "
        "unless the cluster grows"
    )


def check_api_keys(config: ServiceConfig) -> None:
    """Read ``api_keys_file`` here first, as the ingress will where it runs.

    Raises:
        ServeError: the file is unreadable, repeats a key of ``api_keys``, or names an
            unknown class (the ingress would fail to start, and Serve would retry it).
    """
    try:
        check_key_classes(config.all_api_keys(), config.traffic_classes())
    except ValueError as e:
        raise ServeError(str(e)) from e


def deploy(config: ServiceConfig, proxy_port: int | None = None) -> str:
    """Start Serve's HTTP proxy and deploy; return the base URL, ``config.host:port``.

    ``proxy_port``: None puts the proxy on ``config.port`` (a cluster we joined);
    otherwise the proxy listens there and the ingress replica serves ``config.port``
    itself (an embedded cluster started with :func:`embedded_serve_env`).
    Blocks until every replica has loaded the model.
    """
    check_api_keys(config)
    warning = check_resources(config)
    if warning is not None:
        print(f"iterserve: warning: {warning}", flush=True)
    port = config.port if proxy_port is None else proxy_port
    serve.start(http_options={"host": config.host, "port": port})
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    return f"http://{config.host}:{config.port}"


def uses_ray(config: ServiceConfig, address: str | None) -> bool:
    """Whether ``iterserve serve`` runs on Ray Serve (else in this process, without Ray)."""
    return (
        address is not None
        or "RAY_ADDRESS" in os.environ
        or config.num_replicas > 1
        or config.autoscaling is not None
    )


def banner(
    config: ServiceConfig,
    url: str,
    where: str,
    weights: str | None = None,
    tool_template: str | None = None,
) -> str:
    """What ``iterserve serve`` prints once it accepts requests; ``weights``: how a replica
    holds the model's weights, in words (``WeightInfo.describe``); ``tool_template``: the
    chat template that renders tools (``ChatTemplates.describe``), where known."""
    name = config.model_name()
    # A placeholder, not a configured key: the banner goes to logs.
    auth = (
        ' -H "Authorization: Bearer $OPENAI_API_KEY"'
        if (config.api_keys or config.api_keys_file)
        else ""
    )
    n = config.num_replicas
    scaling = config.autoscaling_settings()
    bounds = f", autoscaling {scaling.min_replicas}-{scaling.max_replicas}" if scaling else ""
    return (
        f"\niterserve is ready: {url}/v1 (model {name!r}"
        + (f", weights {weights}" if weights else "")
        + f", tool calls {config.tool_call_parser}"
        + (f" ({tool_template} template)" if tool_template else "")
        + f", {n} replica{'s' * (n != 1)} "
        f"{where}{bounds}, pid {os.getpid()})\n"
        f"  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} \\\n"
        f'    -d \'{{"model": "{name}", "prompt": "The capital of France is", '
        f'"max_tokens": 16, "temperature": 0}}\'\n'
        "Stop with Ctrl-C."
    )


def wait_port_released(host: str, port: int, timeout_s: float = PORT_RELEASE_S) -> None:
    """Wait until Ray Serve's direct ingress can bind ``host:port``: it binds without
    ``SO_REUSEADDR``, so a server stopped moments before on that port (its closed
    connections in TIME_WAIT) would make the deployment fail.

    Raises:
        ServeError: another process listens there, or the port stayed blocked.
    """
    from deploy.local_server import bindable

    deadline = time.monotonic() + timeout_s
    if not bindable(host, port, reuse_addr=False):
        print(
            f"iterserve: waiting for the closed connections of port {port} to clear "
            f"(at most {timeout_s:.0f} s)",
            flush=True,
        )
    while not bindable(host, port, reuse_addr=False):
        if not bindable(host, port):
            raise ServeError(f"port {port} on {host} is in use (choose another with --port)")
        if time.monotonic() > deadline:
            raise ServeError(
                f"port {port} on {host} is still held by closed connections after {timeout_s:.0f} s"
            )
        time.sleep(0.5)


def run_server(config: ServiceConfig, address: str | None = None) -> int:
    """Serve until SIGINT or SIGTERM, then shut down cleanly; the exit status."""
    if not uses_ray(config, address):
        from deploy.local_server import PortInUse, run_local

        try:
            check_api_keys(config)
            url = f"http://{config.host}:{config.port}"
            return run_local(config, lambda w, t: banner(config, url, "in this process", w, t))
        except (ServeError, PortInUse) as e:
            print(f"iterserve: error: {e}", flush=True)
            return 1
    if config.step_log is not None:
        print(
            "iterserve: error: step_log is recorded by the one-process server: "
            "drop --address (and keep num_replicas: 1)",
            flush=True,
        )
        return 1
    return _run_in_own_session(config, address)


def _run_in_own_session(config: ServiceConfig, address: str | None) -> int:
    """Run :func:`_run_on_ray` in a child process of its own session; pass it SIGINT
    and SIGTERM as one SIGTERM and return its exit status.

    Ctrl-C in a terminal, and ``kill -TERM -PGID``, signal every process of the
    server's process group. The Ray processes that ``ray.init`` starts (GCS, raylet, the
    replicas' workers) would be in it: a SIGTERM would kill them before Serve could
    drain, cutting the open streams without their error event. In a session of its own,
    the server alone decides how they stop (:func:`_shutdown`). The child also gets a
    SIGTERM if this process dies (``PR_SET_PDEATHSIG``, Linux), so a SIGKILL here does
    not leave the cluster running.
    """
    if not hasattr(os, "fork"):
        return _run_on_ray(config, address)
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 1
        try:
            os.setsid()
            _term_with_parent(parent)
            code = _run_on_ray(config, address)
        except BaseException:  # noqa: BLE001 - reported, then the child exits
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def forward(sig: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    _, status = os.waitpid(pid, 0)  # retried across the signals (PEP 475)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 1


def _term_with_parent(parent: int) -> None:
    """Ask Linux to send this process SIGTERM when its parent (pid ``parent``) dies
    (elsewhere: nothing)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _run_on_ray(config: ServiceConfig, address: str | None) -> int:
    stop = threading.Event()
    own_cluster = address in (None, "local")
    try:
        if own_cluster:
            wait_port_released(config.host, config.port)
        start_ray(address, config)
        # After ray.init, which installs its own SIGTERM handler (exit without cleanup).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        url = deploy(config, proxy_port=spare_port(config.host) if own_cluster else None)
    except ServeError as e:
        print(f"iterserve: error: {e}", flush=True)
        _shutdown(own_cluster)
        return 1
    print(banner(config, url, "on Ray Serve"), flush=True)
    stop.wait()
    print("iterserve: shutting down", flush=True)
    _drain()
    _shutdown(own_cluster)
    print("iterserve: shut down", flush=True)
    return 0


def _drain() -> None:
    """Have the ingress stop taking requests and finish or end the open ones within
    :data:`deploy.local_server.GRACEFUL_SHUTDOWN_S` (``OpenAIIngress.drain``), so that
    stopping Serve then cuts no stream mid-message."""
    from deploy.local_server import GRACEFUL_SHUTDOWN_S

    try:
        handle = serve.get_app_handle(APP_NAME)
        cut = handle.drain.remote(GRACEFUL_SHUTDOWN_S).result(
            timeout_s=GRACEFUL_SHUTDOWN_S + DRAIN_MARGIN_S
        )
    except Exception as e:  # noqa: BLE001 - Serve's own shutdown follows regardless
        logger.warning("the ingress did not drain: %s: %s", type(e).__name__, e)
        return
    if cut:
        print(f"iterserve: ended {cut} open requests with an error", flush=True)


def _shutdown(own_cluster: bool) -> None:
    """Stop what we started: all of Serve on our own cluster, only our app on a shared one."""
    if not ray.is_initialized():
        return
    # Ctrl-C in a terminal signals the whole process group, Ray's own processes included;
    # Serve's shutdown then waits on a dead controller, so it gets a deadline.
    stopper = threading.Thread(
        target=serve.shutdown if own_cluster else lambda: serve.delete(APP_NAME), daemon=True
    )
    stopper.start()
    stopper.join(SHUTDOWN_TIMEOUT_S)
    if stopper.is_alive():
        logger.warning("Serve did not shut down within %.0f s; stopping Ray", SHUTDOWN_TIMEOUT_S)
    ray.shutdown()
