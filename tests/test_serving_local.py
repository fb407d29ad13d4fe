"""The default ``iterserve serve`` (one replica in its own process, no Ray) through the
HTTP tests of the Ray Serve application (``tests/test_serving.py``), plus what only this
path does: one process, and a clear error for a taken port."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deploy.config import ServiceConfig
from deploy.local_server import CUT_MARGIN_S, GRACEFUL_SHUTDOWN_S
from deploy.server import uses_ray
from router.calls import ReplicaLost
from router.contract import Accepted, SequenceDelta, StepItem
from router.local import LocalCall
from tests import serving_app as app
from tests.serving_app import MODEL, service_config
from tests.serving_errors import (  # noqa: F401  (collected against this module's server)
    test_bad_chat_input,
    test_bad_input_gets_openai_error,
    test_client_disconnect_aborts_and_frees_blocks,
    test_inputs_that_once_stopped_the_engine,
    test_malformed_json_oversized_body_and_auth,
)
from tests.test_serving import (  # noqa: F401  (collected against this module's server)
    test_50_concurrent_streams,
    test_chat_response_format_json_schema,
    test_chat_streaming_equals_non_streaming_with_one_usage_chunk,
    test_completion_matches_transformers_generate,
    test_completion_streaming_equals_non_streaming,
    test_cors_preflight_from_a_browser_origin,
    test_echo_scores_a_prompt_as_transformers_does,
    test_embeddings_through_the_openai_client,
    test_interactive_first_token_while_batch_saturates,
    test_max_tokens_null_means_unset,
    test_n_seed_and_logprobs,
    test_several_prompts_index_choices_across_prompts_and_n,
    test_shared_prefix_is_computed_once,
    test_stop_string_stream_and_not,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def command(tmp_path_factory):
    config = service_config(tmp_path_factory, num_replicas=1)
    with app.running_command(config, tmp_path_factory.mktemp("serve")) as proc:
        proc.url = f"http://{config.host}:{config.port}"
        yield proc


@pytest.fixture(scope="module")
def server(command):
    return command.url


def test_one_process_without_ray(command):
    """The server's session holds one process (a Ray Serve start has a dozen: raylet, GCS,
    the controller, the proxy, the ingress and replica actors), and it says where it runs."""
    members = [
        p.name
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and _session(p.name) == command.pid
    ]
    assert members == [str(command.pid)], members
    ready = command.log.read_text()
    assert "1 replica in this process" in ready
    assert "tool calls hermes (hermes (shipped) template)" in ready


def _session(pid: str) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[3])  # field 6: the session id


def test_models_and_health(server):
    assert [m.id for m in app.client(server).models.list().data] == [MODEL]
    h = app.health(server)
    assert h["status"] == "ok" and h["num_replicas"] == 1
    assert [r["replica"] for r in h["replicas"]] == ["local"]


def test_metrics_count_this_replicas_steps(server):
    app.client(server).completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    text = httpx.get(f"{server}/metrics", timeout=10).text
    steps = [
        line
        for line in text.splitlines()
        if line.startswith("iterserve:iteration_tokens_total_count")
        or line.startswith("iterserve:step_time_seconds_count")
    ]
    assert steps and all('replica="local"' in line for line in steps), steps
    assert any(float(line.rsplit(" ", 1)[1]) > 0 for line in steps), steps


def test_taken_port_fails_before_the_model_loads():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        run = subprocess.run(
            [str(Path(sys.executable).parent / "iterserve"), "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert run.returncode == 1
    assert f"port {port} on 127.0.0.1 is in use" in run.stdout, run.stdout + run.stderr


def test_which_path_serves():
    one = ServiceConfig()
    assert not uses_ray(one, None)
    assert uses_ray(one, "local") and uses_ray(one, "ray://head:10001")
    assert uses_ray(ServiceConfig(num_replicas=2, replica_num_cpus=1), None)


def test_an_engine_failure_ends_the_stream_as_a_lost_replica():
    class Record:
        failed_calls = 0

        def failed(self) -> None:
            self.failed_calls += 1

        def tokens(self, *_) -> None:
            pass

    async def items():
        yield Accepted(3, "local")
        yield StepItem([SequenceDelta(0, "a", [1], None, None, None)], False)
        raise RuntimeError("engine loop failed")

    async def run() -> list:
        call, got = LocalCall(items(), record), []
        await call.start()
        with pytest.raises(ReplicaLost, match="engine loop failed"):
            async for item in call.items():
                got.append(item)
        return got

    record = Record()
    assert len(asyncio.run(run())) == 1 and record.failed_calls == 1


def test_the_log_has_no_traceback_after_every_test_above(command):
    """Bad input, disconnects (a non-streaming one once logged ``InvalidStateError``) and
    load leave no traceback: each is answered, not crashed through."""
    log = command.log.read_text()
    assert "Traceback" not in log, log[-3000:]


def test_ctrl_c_ends_an_open_stream_with_an_error_event_and_done(tmp_path_factory):
    """A stream still open when Ctrl-C's grace period ends gets an OpenAI error event and
    ``[DONE]`` (uvicorn would otherwise cancel it mid-write, with a traceback in the
    log), and the server exits with status 0 (``running_command`` checks it)."""
    config = ServiceConfig(port=app.free_port())
    url = f"http://{config.host}:{config.port}"
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with app.running_command(config, tmp_path_factory.mktemp("ctrl-c")) as proc:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
            events = []
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue  # one Ctrl-C: a second one forces the exit, as uvicorn's
                events.append(line[len("data: ") :])
                if len(events) == 3:
                    start = time.monotonic()
                    proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        took = time.monotonic() - start
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "replica_lost" and "shut down" in error["message"], error
    assert all("choices" in json.loads(e) for e in events[:-2])
    assert GRACEFUL_SHUTDOWN_S - 1 < took < GRACEFUL_SHUTDOWN_S + CUT_MARGIN_S, took
    assert "Traceback" not in proc.log.read_text(), proc.log.read_text()[-3000:]
