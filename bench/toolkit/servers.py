"""Start and stop the servers the HTTP suites compare (:mod:`bench.peers`,
:mod:`bench.prefix_cache`, :mod:`bench.batch`, ...) and any other server process a suite runs
(:class:`Process`); probe them; count CPU per process."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import httpx
import yaml

from bench.toolkit import REPO, loadgen
from bench.toolkit import report as rp
from bench.toolkit.loadgen import LoadRequest
from bench.toolkit.targets import AiohttpTarget, aiohttp_session

PORT = 8123
MODEL_NAME = "SmolLM2-135M-Instruct"
START_TIMEOUT_S = 420.0
STOP_TIMEOUT_S = 40.0
MIX_API_KEY = "peers-bench"
"""With the class mix, iterserve gets a key whose ceiling is the interactive class: without
keys every request is `standard`, and a header asking for a more urgent class gets 403."""
CLASS_HEADER = "x-iterserve-class"
PROBE_PROMPT = "The history of the city of Paris began in the third century BC, when"


@dataclass(frozen=True)
class SystemSpec:
    """One served system: ``kind`` is "iterserve" or "vllm"; ``engine`` overrides
    iterserve's ``engine:`` section and ``service`` its top-level settings, ``env`` its
    environment; ``priority`` starts vLLM with its priority scheduler and ``args`` are more
    of vLLM's command-line arguments; ``ray`` serves iterserve on Ray Serve (an embedded
    cluster, ``--address local``) where it would run in its own process."""

    label: str
    kind: str
    engine: dict | None = None
    service: dict | None = None
    env: dict | None = None
    priority: bool = False
    args: tuple[str, ...] = ()
    ray: bool = False


SYSTEMS = {
    "iterserve": SystemSpec("iterserve", "iterserve"),
    "iterserve-static": SystemSpec(
        "iterserve-static", "iterserve", {"policy": "static", "tpot_slo_guard": False}
    ),
    "vllm": SystemSpec("vllm", "vllm"),
    # The same replica as a Ray Serve deployment (as a cluster or several replicas run).
    "iterserve-ray": SystemSpec("iterserve-ray", "iterserve", ray=True),
    # Without the serving defaults that this benchmark measures: one replica of one CPU
    # on Ray Serve, stats every 0.1 s, Serve's 0.1 s control loop and default (not
    # throughput-optimized) mode, FCFS and no TPOT guard.
    "iterserve-before": SystemSpec(
        "iterserve-before",
        "iterserve",
        {"policy": "fcfs", "tpot_slo_guard": False},
        {"replica_num_cpus": 1, "routing_stats_period_s": 0.1},
        {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"},
        ray=True,
    ),
}


def model_dir() -> str:
    """The embedded default model's converted transformers directory (converts once)."""
    from engine.model.loader import resolve_model_dir

    return str(resolve_model_dir(None))


def engine_env() -> dict[str, str]:
    """Environment for vLLM (and offline runs): as many OpenMP threads as cores."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(os.cpu_count() or 1),
        VLLM_CPU_KVCACHE_SPACE="2",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
    )
    return env


FP32_ENGINE = {"quantization": "none"}
"""iterserve's weights in these suites unless a spec says otherwise: the embedded GGUF
de-quantized to fp32, as vLLM serves it (the converted directory). The packed weights are
compared with llama.cpp by :mod:`bench.peers_packed`."""


def iterserve_config(spec: SystemSpec, slo: tuple[float, float], mix: bool) -> dict:
    """``iterserve serve --config`` content: defaults plus the benchmark's SLOs declared,
    the weights in fp32 (:data:`FP32_ENGINE`) unless the spec's ``engine`` says otherwise."""
    ttft, tpot = slo
    classes = {"standard": {"ttft_slo_s": ttft, "tpot_slo_s": tpot}}
    keys = {}
    if mix:
        classes["interactive"] = {"ttft_slo_s": ttft, "tpot_slo_s": tpot}
        keys = {MIX_API_KEY: {"tenant": "bench", "traffic_class": "interactive"}}
    return {
        "port": PORT,
        **(spec.service or {}),
        "api_keys": keys,
        "engine": {**FP32_ENGINE, **(spec.engine or {}), "traffic_classes": classes},
    }


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A server process for the duration of a ``with`` block: ``command`` in its own session
    (``cwd``, ``env`` over this process's environment), its output in ``log``, serving
    ``model_name`` at ``url``; entered once :meth:`ready` is true, left with SIGINT, then
    whatever is left of its session killed.

    Raises (on entering):
        RuntimeError: it exited, or was not ready within ``START_TIMEOUT_S``.
    """

    def __init__(
        self,
        label: str,
        command: list[str],
        url: str,
        *,
        env: dict[str, str] | None = None,
        cwd: Path = REPO,
        settle_s: float = 0.0,
    ) -> None:
        self.label, self.command, self.url, self.cwd = label, command, url, cwd
        self.model_name = MODEL_NAME
        self.env = {**os.environ, **(env or {})}
        self.settle_s = settle_s
        """Seconds to wait after it stopped, so that the port and the cores settle."""
        self._tmp = tempfile.TemporaryDirectory(prefix=f"server-{label}-")
        self.dir = Path(self._tmp.name)
        self.log = self.dir / "server.log"
        self.proc: subprocess.Popen | None = None

    def ready(self) -> bool:
        """Whether it serves: ``GET /v1/models`` answers 200."""
        return httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200

    def __enter__(self) -> Self:
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                cwd=self.cwd,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited at start:\n{self.log.read_text()[-3000:]}")
            try:
                if self.ready():
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.__exit__(None, None, None)
        raise RuntimeError(f"{self.label} not ready after {START_TIMEOUT_S:.0f} s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
            try:  # whatever is left of its session (Ray's or vLLM's workers)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._tmp.cleanup()
        time.sleep(self.settle_s)


class Server(Process):
    """One of the compared systems (:class:`SystemSpec`: iterserve or vLLM) on ``PORT``, with
    the benchmark's SLOs declared (and the class mix's key, with ``mix``)."""

    def __init__(
        self, spec: SystemSpec, model_dir: str, *, mix: bool, slo: tuple[float, float]
    ) -> None:
        self.spec, self.model_dir, self.kind = spec, model_dir, spec.kind
        label = spec.label + ("+priority" if spec.priority and spec.kind == "vllm" else "")
        super().__init__(label, [], f"http://127.0.0.1:{PORT}", settle_s=2.0)
        if spec.kind == "vllm":
            py = Path(os.environ.get("VLLM_VENV", REPO / ".venv-vllm")) / "bin/python"
            self.command = [
                str(py),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                model_dir,
                "--served-model-name",
                MODEL_NAME,
                "--dtype",
                "float32",
                "--port",
                str(PORT),
            ]
            if spec.priority:
                self.command += ["--scheduling-policy", "priority"]
            self.command += list(spec.args)
            self.env = engine_env()
        else:
            cfg = self.dir / "service.yaml"
            cfg.write_text(yaml.safe_dump(iterserve_config(spec, slo, mix)))
            self.command = [str(REPO / ".venv/bin/iterserve"), "serve", "--config", str(cfg)]
            if spec.ray:
                self.command += ["--address", "local"]
            self.env.update(spec.env or {})
        # With the mix, iterserve has keys, and /v1/models needs one (vLLM ignores it).
        self._auth = {"Authorization": f"Bearer {MIX_API_KEY}"} if mix else {}

    def ready(self) -> bool:
        return httpx.get(f"{self.url}/v1/models", headers=self._auth, timeout=2).status_code == 200

    def __enter__(self) -> Self:
        print(f"[peers] starting {self.label}", flush=True)
        return super().__enter__()


async def token_cost(server: Process, streams: int, tokens: int, warmup: bool = True) -> dict:
    """Steady-state ms between streamed tokens with ``streams`` concurrent streams.

    Each stream decodes ``tokens`` tokens (``ignore_eos``, greedy) from a short prompt,
    sent together by the shared load generator (read with aiohttp, the lighter client on
    the server's cores: :class:`targets.AiohttpTarget`), after one warm-up stream if ``warmup``;
    the gap is measured between its 20th and 80th percentile tokens, so prefill and the
    stream's start and end do not count. Returns the mean over streams (ms per token), and
    ``client_cores``: this process's CPU (the load generator, on the server's cores) over
    the timed streams' wall time, in cores.
    """

    def req(i: int) -> LoadRequest:
        return LoadRequest(f"probe-{i}", -1, None, PROBE_PROMPT, 0, tokens)

    def gap_ms(times: list[float]) -> float:
        a, b = len(times) // 5, (len(times) * 4) // 5
        return 1000 * (times[b] - times[a]) / max(1, b - a)

    async with aiohttp_session() as client:
        target = AiohttpTarget(client, server.url, server.model_name, class_header=None)
        if warmup:
            await loadgen.open_loop(target, [req(-1)])
        cpu0, t0 = _own_cpu_s(), time.perf_counter()
        run = await loadgen.open_loop(target, [req(i) for i in range(streams)])
        client = (_own_cpu_s() - cpu0) / (time.perf_counter() - t0)
    failed = [r["error"] for r in run.records if r["status"] != "finished"]
    if failed:
        raise RuntimeError(f"token-cost probe failed: {failed[0]}")
    gaps = [gap_ms(r["token_s"]) for r in run.records]
    return {
        "streams": streams,
        "tokens": tokens,
        "ms_per_token": sum(gaps) / len(gaps),
        "client_cores": client,
    }


def _own_cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


class OfflineEngine:
    """``python -m bench.toolkit.offline`` (its probe loop) in an engine's venv, for a ``with``
    block.

    ``start()`` loads the engine; it then stays loaded, blocked on its stdin (no CPU)
    between requests: :meth:`measure` runs the offline measurements once, and
    :meth:`decode_ms` a decode probe, so that the two engines' measurements can alternate
    and a served probe be compared with its own engine measured seconds apart.
    """

    def __init__(self, name: str, python: Path, cmd: list[str]) -> None:
        self.name = name
        self.cmd = [
            str(python),
            "-m",
            "bench.toolkit.offline",
            "--engine",
            name,
            *cmd,
        ]
        self.log = tempfile.NamedTemporaryFile(prefix=f"offline-{name}-", suffix=".log")
        self.proc: subprocess.Popen | None = None
        self.probe_cpu_s = 0.0
        """CPU seconds its measurements and probes used: the rest of :meth:`cpu_s` after
        ``start`` was used while idle, which must be about nothing."""

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=engine_env(),
            text=True,
            start_new_session=True,
            cwd=REPO,
        )
        self._answer()  # {"ready": true} once the engine is loaded

    def _ask(self, request: dict) -> dict:
        before = self.cpu_s()
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        self.probe_cpu_s += self.cpu_s() - before
        return answer

    def measure(self, warmup: bool) -> dict:
        """The offline measurements once (:func:`bench.toolkit.offline.measure`)."""
        return self._ask({"measure": {"warmup": warmup}})

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            tail = Path(self.log.name).read_text(errors="replace")[-3000:]
            raise RuntimeError(f"offline {self.name} exited:\n{tail}")
        return json.loads(line)

    def decode_ms(self, streams: int, tokens: int) -> float:
        """ms per decode step of ``streams`` sequences decoding ``tokens`` tokens from
        :data:`PROBE_PROMPT`, as :func:`token_cost` asks the server."""
        ask = {"streams": streams, "tokens": tokens, "prompt": PROBE_PROMPT}
        return self._ask(ask)["ms_per_step"]

    def cpu_s(self) -> float:
        """CPU seconds used so far by the engine's processes: its session
        (``start_new_session``), vLLM's engine-core and worker processes included."""
        total = 0.0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                session, secs = proc_stat(int(pid))
            except OSError:
                continue
            total += secs if session == self.proc.pid else 0.0
        return total

    def __enter__(self) -> OfflineEngine:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
            try:  # vLLM's engine-core process
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.log.close()


async def paired_token_cost(
    server: Process, offline: OfflineEngine, streams: int, tokens: int, rounds: int
) -> dict:
    """:func:`token_cost` and the same decode on the engine offline, in ``rounds``
    adjacent pairs (offline first in even rounds, served first in odd ones, so a drift of
    the host's speed within a round falls on both sides alike). ``overhead`` is the median
    of the pairs' served / offline ratios, minus one; ``client_cores`` the median of the
    load generator's CPU share (see :func:`token_cost`)."""
    # Both sides once at this shape first: a first call pays one-time costs (vLLM's
    # offline engine reads slow in the first pair without it).
    await token_cost(server, streams, 8, warmup=False)
    offline.decode_ms(streams, 8)
    served, alone, client = [], [], []
    for r in range(rounds):
        if r % 2 == 0:
            alone.append(offline.decode_ms(streams, tokens))
        cost = await token_cost(server, streams, tokens, warmup=False)
        served.append(cost["ms_per_token"])
        client.append(cost["client_cores"])
        if r % 2 == 1:
            alone.append(offline.decode_ms(streams, tokens))
    ratios = [s / o for s, o in zip(served, alone)]
    return {
        "streams": streams,
        "tokens": tokens,
        "ms_per_token": statistics.median(served),
        "served_ms": served,
        "offline_ms": alone,
        "offline_ms_per_step": statistics.median(alone),
        "overhead": statistics.median(ratios) - 1,
        "client_cores": statistics.median(client),
    }


PROCESS_GROUPS = (
    ("ModelReplica", "iterserve replica"),
    ("OpenAIIngress", "iterserve ingress"),
    ("ProxyActor", "Ray Serve HTTP proxy"),
    ("ServeController", "Ray Serve controller"),
    ("EngineCore", "vLLM engine core"),
    ("VLLM::", "vLLM engine core"),
    ("vllm.entrypoints", "vLLM API server"),
    ("bench.peers", "load generator"),
    ("raylet", "Ray system"),
    ("gcs_server", "Ray system"),
    ("ray", "Ray system"),
    ("iterserve serve", "iterserve serve (the server, or Ray's driver)"),
)


def proc_stat(pid: int, tid: int | None = None) -> tuple[int, float]:
    """(session id, CPU seconds user + system) of a process, or of one of its threads,
    from ``/proc``. Raises OSError once it has exited."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return int(fields[3]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """pid -> (process group name, CPU seconds used so far), from /proc."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            secs = proc_stat(int(pid))[1]
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        group = next((g for key, g in PROCESS_GROUPS if key in cmd), "other")
        out[int(pid)] = (group, secs)
    return out


def cpu_share(before: dict, after: dict, wall_s: float) -> dict[str, float]:
    """Cores each process group kept busy between two :func:`cpu_seconds` readings."""
    share: dict[str, float] = {}
    for pid, (group, secs) in after.items():
        used = secs - before.get(pid, (group, 0.0))[1]
        if used > 0:
            share[group] = share.get(group, 0.0) + used / wall_s
    return dict(sorted(share.items(), key=lambda kv: -kv[1]))


def machine_info() -> dict:
    """Cores, CPU model, commit and the two systems' versions, for the report."""
    vllm = sorted((REPO / ".venv-vllm/lib").glob("python*/site-packages/vllm_cpu-*.dist-info"))
    return {
        "cores": os.cpu_count(),
        "cpu": rp.cpu_model(),
        "commit": rp.commit(),
        "torch": rp.package_version("torch"),
        "ray": rp.package_version("ray"),
        "vllm_cpu": vllm[-1].name.removesuffix(".dist-info").split("-")[1] if vllm else None,
    }
