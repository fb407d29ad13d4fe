"""The real application for the serving tests: started as `iterserve serve` starts it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import ray
import yaml
from ray import serve

from deploy.config import ServiceConfig
from deploy.server import deploy, embedded_serve_env, spare_port


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
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING",
             log_to_driver=False)
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
def running_command(config: ServiceConfig, tmp: Path) -> Iterator[subprocess.Popen]:
    """``iterserve serve --config`` with ``config``, in its own session; yields the process
    once it printed that it is ready, and stops it with Ctrl-C's SIGINT after, which must
    end it with status 0 within 30 s."""
    path = tmp / "service.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    log = tmp / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "iterserve"), "serve",
                                 "--config", str(path)], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while "is ready" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        proc.log = log
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
        if h.get("replicas") and all(r["running"] == 0 and r["waiting"] == 0
                                     and r["kv_usage"] == 0 for r in h["replicas"]):
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"replicas still busy after {timeout_s} s: {h}")
        time.sleep(0.1)
