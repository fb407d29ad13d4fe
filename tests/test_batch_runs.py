"""Real batch runs: killed and resumed, against the API, through a service, as a Ray job.

Every run is a separate process started as a user starts it (``python -m deploy.batch``
or ``ray job submit``), on the embedded model.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from deploy.config import ServiceConfig
from tests.embedding_reference import compare
from tests.ray_head import ray, ray_env, start_head, stop_head
from tests.serving_app import free_port, running_local

pytestmark = pytest.mark.slow  # real batch commands, a Ray head and ray job submit

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
BAD = {"broken": 400, "badbody": 400, "toolong": 400, "badurl": 404}
"""The input's bad lines -> the status their records must carry ("broken" is line 2)."""


def _batch_file(path: Path, good: int = 24) -> list[str]:
    """A batch of ``good`` requests (the three URLs; completions of 2 to 48 tokens, so
    records finish one by one) and four bad lines; returns the good lines' ids."""
    rows, ids = [], []
    for i in range(good):
        n = 2 + 2 * i
        if i % 8 == 4:
            url, body = "/v1/embeddings", {"input": [f"Item {i}: the city of", "a harbour"]}
        elif i % 3 == 2:
            url, body = (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": f"Tell me fact number {i}."}]},
            )
        else:
            url, body = "/v1/completions", {"prompt": f"Item {i}: the city of"}
        body.update(model=MODEL)
        if url != "/v1/embeddings":
            body.update(max_tokens=n, temperature=0)
        if i == 5:  # a tool call, as the chat API takes it
            body.update(tools=[WEATHER], tool_choice="required", max_tokens=64)
        rows.append(
            json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
        )
        ids.append(f"req-{i}")
    rows.insert(1, '{"custom_id": "broken", "body": {')
    rows.append(
        json.dumps(
            {
                "custom_id": "badbody",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": MODEL, "prompt": "x", "top_p": 7},
            }
        )
    )
    rows.append(
        json.dumps(
            {
                "custom_id": "toolong",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": MODEL, "prompt": [100] * 9000, "max_tokens": 1},
            }
        )
    )
    rows.append(
        json.dumps(
            {"custom_id": "badurl", "method": "POST", "url": "/v1/edits", "body": {"model": MODEL}}
        )
    )
    path.write_text("\n".join(rows) + "\n")
    return ids


def _records(path: Path) -> dict[str, dict]:
    """The output's records by custom_id; fails if one is there twice."""
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    counts = collections.Counter(r["custom_id"] for r in recs)
    assert max(counts.values()) == 1, counts.most_common(3)
    return {r["custom_id"]: r for r in recs}


def _count(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_records(path: Path, n: int, proc: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _count(path) < n:
        assert proc is None or proc.poll() is None, "the run ended before it was stopped"
        assert time.monotonic() < deadline, f"fewer than {n} records after {timeout_s} s"
        time.sleep(0.2)


def _check_complete(out: Path, good: list[str]) -> dict[str, dict]:
    recs = _records(out)
    assert set(recs) == set(good) | {"line-2", "badbody", "toolong", "badurl"}
    for cid in good:
        r = recs[cid]
        assert r["error"] is None and r["response"]["status_code"] == 200, r
        body = r["response"]["body"]
        assert body.get("choices") or len(body["data"]) == 2, r
    statuses = {
        cid: recs["line-2" if cid == "broken" else cid]["response"]["status_code"] for cid in BAD
    }
    assert statuses == BAD
    assert recs["toolong"]["error"]["code"] == "context_length_exceeded"
    assert recs["badbody"]["response"]["body"]["error"]["param"] == "top_p"
    return recs


def _text(body: dict) -> list[tuple[str, str, list]]:
    """Each choice's text, finish reason and calls (without their ids)."""
    return [
        (
            c.get("text", (c.get("message") or {}).get("content")),
            c["finish_reason"],
            [t["function"] for t in (c.get("message") or {}).get("tool_calls", [])],
        )
        for c in body["choices"]
    ]


def _same(got: dict, want: dict) -> None:
    """Two answers to one line agree: a completion's texts and finish reasons, an
    embedding's vectors (within the reference bounds: two batches' sums may round apart)."""
    if "choices" in want:
        assert _text(got) == _text(want)
        return
    assert got["usage"] == want["usage"] and len(got["data"]) == len(want["data"])
    for a, b in zip(got["data"], want["data"]):
        compare(a["embedding"], torch.tensor(b["embedding"]))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[Path, Path, list[str], int, str]:
    """A run killed (SIGKILL to its process group) after its first records, then rerun."""
    tmp = tmp_path_factory.mktemp("batch")
    src, out = tmp / "in.jsonl", tmp / "out.jsonl"
    good = _batch_file(src)
    cmd = [sys.executable, "-m", "deploy.batch", "--input", str(src), "--output", str(out)]
    first = subprocess.Popen(
        cmd, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        # The 4 bad lines are written at once; wait for some answered requests too.
        _wait_records(out, 7, first, timeout_s=240)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    killed_at = _count(out)
    rerun = subprocess.run(
        cmd + ["--ordered"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    return src, out, good, killed_at, rerun.stderr


def test_killed_run_resumes_with_every_record_exactly_once(resumed):
    src, out, good, killed_at, log = resumed
    total = len(good) + len(BAD)
    assert 7 <= killed_at < total
    _check_complete(out, good)
    assert f"{killed_at} already in" in log
    assert "starting 1 replica(s) of" in log and "GPUs in this process" in log  # no Ray
    assert f"{total - killed_at}/{total - killed_at}" in log  # the progress bar finished
    ordered = [
        json.loads(t)["custom_id"]
        for t in out.with_name("out.ordered.jsonl").read_text().splitlines()
    ]
    assert ordered == [good[0], "line-2", *good[1:], "badbody", "toolong", "badurl"]


def test_batch_answers_equal_the_apis_and_via_service(resumed, tmp_path):
    src, out, good, _, _ = resumed
    recs = _records(out)
    [called] = recs["req-5"]["response"]["body"]["choices"]
    assert called["finish_reason"] == "tool_calls"
    assert called["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    lines = {
        json.loads(t)["custom_id"]: json.loads(t)
        for t in src.read_text().splitlines()
        if t.startswith('{"custom_id": "req-')
    }
    config = ServiceConfig(port=free_port())
    # The one-process server: the same ingress and engine as on Ray Serve, without a Ray
    # start (test_serving.py covers the Ray path's answers).
    with running_local(config) as (url, _):

        def ask(cid: str) -> httpx.Response:
            return httpx.post(url + lines[cid]["url"], json=lines[cid]["body"], timeout=120)

        # Eight at a time, as a client would: greedy answers do not depend on the batch.
        with ThreadPoolExecutor(8) as pool:
            for cid, resp in zip(good, pool.map(ask, good)):
                assert resp.status_code == 200, resp.text
                _same(resp.json(), recs[cid]["response"]["body"])
        via = tmp_path / "via.jsonl"
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "deploy.batch",
                "--input",
                str(src),
                "--output",
                str(via),
                "--via-service",
                url,
                "--max-concurrency",
                "4",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
    via_recs = _check_complete(via, good)
    for cid in good:
        _same(via_recs[cid]["response"]["body"], recs[cid]["response"]["body"])
        assert via_recs[cid]["response"]["request_id"].startswith(("cmpl-", "chatcmpl-", "embd-"))


def test_ray_job_submit_stop_and_resubmit_exactly_once(tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = _batch_file(src)
    env = ray_env()
    assert ray("get-auth-token", "--generate", env=env).returncode == 0
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths
    head, address = start_head(temp_dir, env)
    try:
        job = ["job", "submit", "--address", address, "--working-dir", str(REPO)]
        entry = ["--", "python", "-m", "deploy.batch", "--input", str(src), "--output", str(out)]
        first = ray(*job, "--submission-id", "batch-1", "--no-wait", *entry, env=env)
        assert first.returncode == 0, first.stderr[-2000:]
        _wait_records(out, 7, None, timeout_s=240)
        stop = ray("job", "stop", "--address", address, "batch-1", env=env)
        assert stop.returncode == 0, stop.stderr[-2000:]
        status = ray("job", "status", "--address", address, "batch-1", env=env)
        assert "was stopped" in status.stdout + status.stderr
        stopped_at = _count(out)
        assert stopped_at < len(good) + len(BAD)
        second = ray(*job, "--submission-id", "batch-2", *entry, env=env, timeout=300)
        assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
        assert f"{stopped_at} already in" in second.stdout + second.stderr
        assert "GPUs as Ray actors" in second.stdout + second.stderr  # the job's cluster
        _check_complete(out, good)
    finally:
        stop_head(head)
        shutil.rmtree(temp_dir, ignore_errors=True)
