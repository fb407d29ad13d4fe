"""The batch file formats and the resumable output file (no model, no Ray)."""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import pytest
import yaml

from deploy.batch import _engine_config, add_arguments, apply_config
from deploy.batch import main as batch_main
from deploy.batch_engine import plan_local
from deploy.batch_format import (
    BatchFileError,
    OutputFile,
    error_record,
    read_input,
    record,
)
from deploy.batch_service import ServiceGaveUp, run_via_service
from engine import EngineConfig
from engine.llm import OFFLINE_MAX_NUM_BATCHED_TOKENS, OFFLINE_MAX_NUM_SEQS
from router.errors import ApiError

MODEL = "SmolLM2-135M-Instruct"


def _line(cid: str, url: str = "/v1/completions", **extra) -> str:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body, **extra})


def _write(path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_the_three_urls_and_bad_lines_become_error_lines(tmp_path):
    src = _write(
        tmp_path / "in.jsonl",
        [
            _line("a"),
            _line("b", url="/v1/chat/completions"),
            '{"custom_id": "c", "url": ',
            "",
            _line("d", url="/v1/moderations"),
            _line("h", url="/v1/embeddings"),
            _line("e", method="GET"),
            json.dumps(
                {
                    "custom_id": "f",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": "not an object",
                }
            ),
            json.dumps(
                {
                    "custom_id": "g",
                    "url": "/v1/completions",
                    "body": {"model": MODEL, "prompt": "x", "stream": True},
                }
            ),
            "[1, 2]",
        ],
    )
    lines = {line.custom_id: line for line in read_input(src)}
    assert list(lines) == ["a", "b", "line-3", "d", "h", "e", "f", "g", "line-10"]
    for cid, url in (("a", "/v1/completions"), ("b", "/v1/chat/completions")):
        assert lines[cid].error is None and lines[cid].url == url
    assert lines["h"].error is None and lines["h"].url == "/v1/embeddings"
    assert lines["line-3"].error.status == 400 and lines["line-3"].error.code == "invalid_json"
    assert "line 3" in lines["line-3"].error.message
    assert lines["d"].error.status == 404 and lines["d"].error.param == "url"
    assert lines["e"].error.param == "method"
    assert lines["f"].error.param == "body"
    assert lines["g"].error.param == "stream"
    assert lines["line-10"].error.code == "invalid_json"


def test_missing_and_repeated_ids_are_refused_naming_the_lines(tmp_path):
    src = _write(
        tmp_path / "in.jsonl",
        [
            _line("a"),
            _line("b"),
            _line("a"),
            json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
            _line(""),
        ],
    )
    with pytest.raises(BatchFileError) as e:
        read_input(src)
    msg = str(e.value)
    assert "line 3 repeats custom_id 'a' of line 1" in msg
    assert "line 4 has no custom_id" in msg and "line 5 has no custom_id" in msg


def test_the_command_refuses_before_running_anything(tmp_path, capsys):
    src = _write(tmp_path / "in.jsonl", [_line("a"), _line("a")])
    out = tmp_path / "out.jsonl"
    assert batch_main(["--input", src, "--output", str(out)]) == 2
    assert "line 2 repeats custom_id 'a'" in capsys.readouterr().err
    assert not out.exists()


def test_records_have_openai_batch_shapes():
    ok = record("a", 200, "cmpl-1", {"id": "cmpl-1", "choices": []})
    assert set(ok) == {"id", "custom_id", "response", "error"}
    assert ok["error"] is None and ok["id"].startswith("batch_req_")
    assert ok["response"] == {
        "status_code": 200,
        "request_id": "cmpl-1",
        "body": {"id": "cmpl-1", "choices": []},
    }
    bad = error_record("b", ApiError(404, "no such url", param="url", code="unknown_url"))
    assert bad["response"]["status_code"] == 404
    assert bad["response"]["body"]["error"]["type"] == "not_found_error"
    assert bad["error"] == {"code": "unknown_url", "message": "no such url"}


def test_output_file_repairs_a_torn_line_and_resumes(tmp_path):
    path = tmp_path / "out.jsonl"
    done = [json.dumps(record(c, 200, "r", {})) for c in ("a", "b")]
    path.write_text("\n".join(done) + "\n" + done[0][:17])  # killed mid-write
    out = OutputFile(path, {"a", "b", "c"})
    assert out.done == {"a", "b"} and out.repaired_bytes == 17
    out.write(record("c", 200, "r", {}))
    out.close()
    ids = [json.loads(line)["custom_id"] for line in path.read_text().splitlines()]
    assert ids == ["a", "b", "c"]


def test_output_file_of_another_input_is_refused(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text(json.dumps(record("zzz", 200, "r", {})) + "\n")
    with pytest.raises(BatchFileError, match="'zzz'"):
        OutputFile(path, {"a"})
    path.write_text("not a record\n" + json.dumps(record("a", 200, "r", {})) + "\n")
    with pytest.raises(BatchFileError, match="line 1"):
        OutputFile(path, {"a"})
    # A file that is not an output keeps its last line (the torn-line repair comes after
    # the check), and the input itself given as the output is no output.
    notes = "line one of my notes\nline two of my notes"
    path.write_text(notes)
    with pytest.raises(BatchFileError, match="line 1"):
        OutputFile(path, {"a"})
    assert path.read_text() == notes
    path.write_text(_line("a") + "\n")
    with pytest.raises(BatchFileError, match="line 1 is not a batch output record"):
        OutputFile(path, {"a"})


def test_ordered_copy_follows_the_input(tmp_path):
    src = _write(tmp_path / "in.jsonl", [_line("x"), _line("y"), _line("z")])
    lines = read_input(src)
    out = OutputFile(tmp_path / "out.jsonl", {"x", "y", "z"})
    for cid in ("z", "x", "y"):
        out.write(record(cid, 200, "r", {}))
    dest = out.write_ordered(lines)
    out.close()
    assert dest.name == "out.ordered.jsonl"
    assert [json.loads(t)["custom_id"] for t in dest.read_text().splitlines()] == ["x", "y", "z"]


def _service(answers: list[httpx.Response]):
    """A stand-in service answering each POST with the next of ``answers``."""
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers.pop(0)

    return httpx.MockTransport(handle), seen


def test_via_service_retries_after_429_and_sends_the_batch_class():
    ok = {"id": "cmpl-1", "choices": [{"text": "x"}], "usage": {"completion_tokens": 1}}
    transport, seen = _service(
        [
            httpx.Response(429, headers={"Retry-After": "0"}, json={"error": {}}),
            httpx.Response(503, headers={"Retry-After": "0"}, json={"error": {}}),
            httpx.Response(200, headers={"x-request-id": "cmpl-1"}, json=ok),
        ]
    )
    done = {}
    asyncio.run(
        run_via_service(
            "http://svc",
            [("a", "/v1/completions", {"prompt": "p"})],
            lambda cid, ans: done.update({cid: ans}),
            concurrency=1,
            transport=transport,
        )
    )
    assert len(seen) == 3 and all(r.headers["x-iterserve-class"] == "batch" for r in seen)
    assert done["a"].status == 200 and done["a"].request_id == "cmpl-1"
    assert done["a"].completion_tokens == 1


def test_via_service_stops_on_a_refused_key_and_on_endless_503():
    transport, _ = _service([httpx.Response(401, json={"error": {"message": "bad key"}})])
    with pytest.raises(ServiceGaveUp, match="OPENAI_API_KEY"):
        asyncio.run(
            run_via_service(
                "http://svc",
                [("a", "/v1/completions", {})],
                lambda *_: pytest.fail("nothing may be written"),
                transport=transport,
            )
        )
    transport, seen = _service([httpx.Response(503, headers={"Retry-After": "0"})] * 3)
    with pytest.raises(ServiceGaveUp, match="1 requests got no answer"):
        asyncio.run(
            run_via_service(
                "http://svc",
                [("a", "/v1/completions", {})],
                lambda *_: pytest.fail("nothing may be written"),
                max_retries=2,
                transport=transport,
            )
        )
    assert len(seen) == 3


def test_via_service_sends_nothing_more_once_a_request_gave_up():
    transport, seen = _service([httpx.Response(503, headers={"Retry-After": "0"})] * 2)
    work = [(cid, "/v1/completions", {}) for cid in "abc"]
    with pytest.raises(ServiceGaveUp, match=r"3 requests got no answer .*'a': HTTP 503"):
        asyncio.run(
            run_via_service(
                "http://svc",
                work,
                lambda *_: pytest.fail("nothing may be written"),
                concurrency=1,
                max_retries=1,
                transport=transport,
            )
        )
    assert len(seen) == 2

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(ServiceGaveUp, match="could not reach it .ConnectError"):
        asyncio.run(
            run_via_service(
                "http://svc",
                work,
                lambda *_: None,
                max_retries=0,
                transport=httpx.MockTransport(refuse),
            )
        )


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--via-service", "http://svc", "--num-replicas", "2", "--model", "m"],
            "--model, --num-replicas: these set up engine replicas",
        ),
        (["--max-concurrency", "4"], "--max-concurrency applies to --via-service only"),
    ],
)
def test_flags_the_run_would_ignore_are_refused(tmp_path, capsys, flags, message):
    src = _write(tmp_path / "in.jsonl", [_line("a")])
    out = tmp_path / "out.jsonl"
    assert batch_main(["--input", src, "--output", str(out), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--replica-num-cpus", "--max-concurrency", "--num-replicas"])
def test_sizes_must_be_positive(tmp_path, capsys, flag):
    with pytest.raises(SystemExit):
        batch_main(["--input", "in", "--output", "out", flag, "0"])
    assert "must be positive, got 0" in capsys.readouterr().err


def test_a_local_replica_must_fit_this_machine(tmp_path, capsys):
    import os

    cpus = len(os.sched_getaffinity(0))
    assert plan_local(None, 0.0).num_cpus == cpus  # the whole machine, as serve gives it
    assert plan_local(1, 0.0).num_cpus == 1
    src = _write(tmp_path / "in.jsonl", [_line("a")])
    out = tmp_path / "out.jsonl"
    assert batch_main(["-i", src, "-o", str(out), "--replica-num-cpus", str(cpus + 1)]) == 2
    # plan_local's message: a Ray cluster's would say "do not fit this cluster".
    assert f"does not fit this machine ({cpus} CPUs" in capsys.readouterr().err
    assert not out.read_text()


def test_config_file_fills_what_flags_leave_and_keeps_its_engine_section(tmp_path):
    cfg = tmp_path / "service.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "num_replicas": 3,
                "replica_num_cpus": 4,
                "served_model_name": "m1",
                "engine": {"dtype": "float32", "max_num_seqs": 16, "block_size": 32},
            }
        )
    )
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "-i",
            "in",
            "-o",
            "out",
            "--config",
            str(cfg),
            "--num-replicas",
            "2",
            "--max-num-seqs",
            "8",
        ]
    )
    engine = _engine_config(args, apply_config(args))
    # Flags win; the file fills the rest; its engine section is taken as written, over the
    # offline engine's defaults (FCFS, no TPOT guard, its budget), not the server's.
    assert (args.num_replicas, args.replica_num_cpus, args.served_model_name) == (2, 4, "m1")
    assert (engine["max_num_seqs"], engine["block_size"], engine["dtype"]) == (8, 32, "float32")
    assert engine["policy"] == "fcfs" and not engine["tpot_slo_guard"]
    assert engine["max_num_batched_tokens"] == OFFLINE_MAX_NUM_BATCHED_TOKENS != 512
    cfg.write_text(yaml.safe_dump({"engine": {"max_num_batched_tokens": 256}}))
    assert _engine_config(args, apply_config(args))["max_num_batched_tokens"] == 256
    # With neither flag nor file, a step runs the offline engine's requests, not the server's.
    args.max_num_seqs = None
    assert _engine_config(args, apply_config(args))["max_num_seqs"] == OFFLINE_MAX_NUM_SEQS
    assert OFFLINE_MAX_NUM_SEQS > EngineConfig().max_num_seqs
    cfg.write_text(yaml.safe_dump({"engine": {"max_num_seq": 16}}))
    with pytest.raises(ValueError, match="max_num_seq"):
        apply_config(args)


def test_an_autoscaled_config_runs_as_many_replicas_as_fit(tmp_path):
    cfg = tmp_path / "service.yaml"
    cfg.write_text(yaml.safe_dump({"num_replicas": "auto", "autoscaling": {"max_replicas": 4}}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["-i", "in", "-o", "out", "--config", str(cfg)])
    apply_config(args)
    assert args.num_replicas is None  # plan_replicas: as many as the cluster fits
