"""A Ray head of a test's own, started as a user starts one (``ray start --head``): its own
temp dir and ports, token authentication, the dashboard on loopback; stopped through its own
process (``ray stop`` would stop every Ray on the machine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.serving_app import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def ray_env(**extra: str) -> dict[str, str]:
    """The environment for ``ray`` and ``serve`` commands against a token-auth cluster."""
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_AUTH_MODE": "token",
        **extra,
    }
    env.pop("RAY_ADDRESS", None)
    return env


def cli(command: str, *args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run one of the venv's commands (``ray``, ``serve``) from the repository root."""
    return subprocess.run(
        [str(BIN / command), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def ray(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return cli("ray", *args, env=env, timeout=timeout)


def start_head(temp_dir: str, env: dict) -> tuple[subprocess.Popen, str]:
    """A Ray head of our own (own temp dir and ports, token authentication); its job
    server's address once it answers."""
    dash = free_port()
    ports = [
        "--port",
        str(free_port()),
        "--dashboard-port",
        str(dash),
        "--ray-client-server-port",
        str(free_port()),
        "--dashboard-agent-listen-port",
        str(free_port()),
        "--metrics-export-port",
        str(free_port()),
        "--min-worker-port",
        "21000",
        "--max-worker-port",
        "21200",
    ]
    head = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--temp-dir",
            temp_dir,
            "--node-ip-address",
            "127.0.0.1",
            "--dashboard-host",
            "127.0.0.1",
            "--include-dashboard",
            "true",
            "--num-cpus",
            "2",
            *ports,
        ],
        env=env,
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = f"http://127.0.0.1:{dash}"
    deadline = time.monotonic() + 120
    while ray("job", "list", "--address", address, env=env).returncode != 0:
        assert head.poll() is None, "ray start exited"
        assert time.monotonic() < deadline, "the Ray head's job server did not come up"
        time.sleep(1)
    return head, address


def stop_head(head: subprocess.Popen) -> None:
    """Stop only the cluster this test started (``ray stop`` would stop every one)."""
    head.send_signal(signal.SIGTERM)  # `ray start --block` then stops its processes
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()
