"""The real application for the serving tests: started as `iterserve serve` starts it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import ray
import uvicorn
import yaml
from ray import serve

from deploy.config import ServiceConfig
from deploy.engine_replica import EngineReplica
from deploy.local_server import build_local
from deploy.server import deploy, embedded_serve_env, spare_port

MODEL = "SmolLM2-135M-Instruct"
KEYS = {
    "sk-interactive": {"tenant": "alice", "traffic_class": "interactive"},
    "sk-standard": {"tenant": "carol", "traffic_class": "standard"},
    "sk-batch": {"tenant": "bob", "traffic_class": "batch"},
}
NUM_KV_BLOCKS = 512  # 8192 tokens: a 5000-token request fits the context but not the cache
MAX_NUM_SEQS = 8  # few seats: short steps (32 took about 0.95 s a step on a CI host)
# The saturation test's interactive request waits for the step in flight and then its
# own. On a loaded 2-core host two steps can near the default 2 s TTFT SLO, and admission
# then rightly refuses it (429). Behind the batch queue it would wait some 40 steps.
INTERACTIVE_TTFT_SLO_S = 5.0
PROMPT = "The capital of France is"


def service_config(tmp_path_factory, num_replicas: int, **more) -> ServiceConfig:
    """The serving tests' configuration (``tests/test_serving.py`` and
    ``tests/test_serving_local.py``)."""
    # Two keys come from a file, as the Helm chart mounts them from a Secret.
    keys_file = tmp_path_factory.mktemp("keys") / "api_keys.yaml"
    keys_file.write_text(yaml.safe_dump({k: KEYS[k] for k in ("sk-interactive", "sk-batch")}))
    return ServiceConfig(
        num_replicas=num_replicas,
        port=free_port(),
        api_keys={"sk-standard": KEYS["sk-standard"]},
        api_keys_file=str(keys_file),
        engine={
            "policy": "priority",
            "tpot_slo_guard": True,
            "num_kv_blocks": NUM_KV_BLOCKS // 2,
            "max_num_seqs": MAX_NUM_SEQS,
            "max_model_len": 8192,
            "embedding_dimensions": [64],
            # A class that can never meet its SLO under load and goes after everything:
            # it shows admission's 429 without touching the other classes.
            "traffic_classes": {
                "tight": {
                    "ttft_slo_s": 0.01,
                    "tpot_slo_s": 0.01,
                    "default_priority": 3,
                    "max_queue_wait_s": 0.3,
                },
                "interactive": {"ttft_slo_s": INTERACTIVE_TTFT_SLO_S},
            },
        },
        **more,
    )


def post(
    url: str, path: str, body: dict | bytes, key: str | None = "sk-standard", **headers: str
) -> httpx.Response:
    h = {"Content-Type": "application/json", **headers}
    if key:
        h["Authorization"] = f"Bearer {key}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=content, headers=h, timeout=120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_app(config: ServiceConfig, replicas: int) -> Iterator[str]:
    """The application on a 2-CPU Ray cluster; yields its base URL once ``replicas`` are
    healthy, and shuts Serve and Ray down after."""
    # As `iterserve serve` runs it: the ingress replica serves the port itself.
    saved = dict(os.environ)
    os.environ.update(embedded_serve_env(config))
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    os.environ.clear()
    os.environ.update(saved)
    try:
        url = deploy(config, proxy_port=spare_port(config.host))
        wait_health(url, replicas=replicas, timeout_s=60)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


@contextmanager
def running_local(config: ServiceConfig) -> Iterator[tuple[str, EngineReplica]]:
    """``config`` served as ``iterserve serve`` serves one replica, from a thread of this
    process; yields ``(base URL, replica)`` once the port answers, and stops the server and
    the engine after."""
    server, replica = build_local(config)
    # uvicorn's own server: build_local's handles signals, which only the main thread may.
    plain = uvicorn.Server(server.config)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(plain.serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not plain.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://{config.host}:{config.port}", replica
    finally:
        plain.should_exit = True
        thread.join(timeout=30)
        # The loop has left serve(): stop the engine's thread on it, as the server does.
        loop.run_until_complete(replica.engine.shutdown())
        loop.close()


def start_serve(config: ServiceConfig | list[str], tmp: Path) -> subprocess.Popen:
    """``iterserve serve`` in a session of its own, its output in ``tmp/serve.log`` (the
    process's ``log``): with ``config`` written to ``tmp/service.yaml``, or with the flags
    ``config``. Returns at once (see :func:`wait_ready`)."""
    args = config
    if isinstance(config, ServiceConfig):
        path = tmp / "service.yaml"
        path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
        args = ["--config", str(path)]
    log = tmp / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "iterserve"), "serve", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    proc.log = log
    return proc


def wait_ready(proc: subprocess.Popen, timeout_s: float = 180) -> None:
    """Wait until :func:`start_serve`'s server printed that it is ready.

    Raises:
        AssertionError: it exited, or was not ready within ``timeout_s`` (the log's tail).
    """
    deadline = time.monotonic() + timeout_s
    while "is ready" not in proc.log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.log.read_text()[-3000:]
        time.sleep(0.2)


@contextmanager
def running_command(config: ServiceConfig, tmp: Path) -> Iterator[subprocess.Popen]:
    """``iterserve serve --config`` with ``config``, in its own session; yields the process
    once it printed that it is ready, and stops it with Ctrl-C's SIGINT after, which must
    end it with status 0 within 30 s."""
    proc = start_serve(config, tmp)
    log = proc.log
    try:
        wait_ready(proc)
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert code == 0, log.read_text()[-3000:]


def client(url: str, key: str = "sk-standard") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def wait_health(url: str, replicas: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        h = health(url)
        if h.get("status") == "ok" and len(h["replicas"]) >= replicas:
            return h
        if time.monotonic() > deadline:
            raise AssertionError(f"not {replicas} healthy replicas after {timeout_s} s: {h}")
        time.sleep(0.5)


def wait_idle(url: str, timeout_s: float = 10) -> float:
    """Seconds until every replica reports no running request and no KV block in use."""
    start = time.monotonic()
    while True:
        h = health(url)
        if h.get("replicas") and all(
            r["running"] == 0 and r["waiting"] == 0 and r["kv_usage"] == 0 for r in h["replicas"]
        ):
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"replicas still busy after {timeout_s} s: {h}")
        time.sleep(0.1)
