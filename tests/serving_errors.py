"""Bad input and clients that leave, through the real server: an OpenAI error (400, 401,
403, 404, 413) naming the field, never a 500, no request left running, and the server
healthy after. Not collected on its own: imported by
``tests/test_serving.py`` (Ray Serve) and ``tests/test_serving_local.py`` (one process),
each running these against its own module's ``server`` fixture."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests import serving_app as app
from tests.serving_app import MODEL, NUM_KV_BLOCKS, PROMPT, post


@pytest.mark.parametrize(
    "body,status,param,needle",
    [
        (
            {"model": MODEL, "prompt": "a", "max_tokens": -1},
            400,
            "max_tokens",
            "greater than or equal to 0",
        ),
        ({"model": MODEL, "prompt": "a", "n": 0}, 400, "n", "greater than or equal to 1"),
        ({"model": MODEL, "prompt": "a", "n": 9}, 400, "n", "cap of 8"),
        (
            {"model": MODEL, "prompt": "a", "temperature": -0.5},
            400,
            "temperature",
            "greater than or equal to 0",
        ),
        ({"model": MODEL, "prompt": "a", "top_p": 0}, 400, "top_p", "greater than 0"),
        ({"model": MODEL, "prompt": "a", "top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt", "empty"),
        ({"model": MODEL, "prompt": "a", "max_tokens": 9000}, 400, "prompt", "context of 8192"),
        (
            {"model": MODEL, "prompt": "a", "max_tokens": 5000},
            400,
            "prompt",
            f"KV cache capacity of {NUM_KV_BLOCKS // 2 * 16}",
        ),
        ({"model": "gpt-4", "prompt": "a"}, 404, "model", "does not exist"),
        ({"prompt": "a"}, 400, "model", "required"),
        ({"model": MODEL, "prompt": "a", "suffix": "!"}, 400, "suffix", "not supported"),
        (
            {
                "model": MODEL,
                "prompt": "a",
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            400,
            "tools",
            "not supported",
        ),
        ({"model": MODEL, "prompt": "a", "frobnicate": 1}, 400, "frobnicate", "not a parameter"),
        (
            {"model": MODEL, "prompt": "a", "logit_bias": {"99999999": 1}},
            400,
            "logit_bias",
            "token id 99999999 is outside the vocabulary",
        ),
        (
            {"model": MODEL, "prompt": "a", "max_tokens": 2, "min_tokens": 3},
            400,
            "min_tokens",
            "<= max_tokens",
        ),
        ({"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens", "needs echo"),
        ({"model": MODEL, "prompt": ["a", "b", "c"], "n": 3}, 400, "n", "cap of 8"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_gets_openai_error(server, body, status, param, needle, stream):
    r = post(server, "/v1/completions", {**body, "stream": stream})
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")  # before any stream
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and needle in err["message"], err


def test_bad_chat_input(server):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        app.client(server).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x " * 9000}], max_tokens=4
        )
    assert "context" in str(e.value)
    tools = [{"type": "function", "function": {"name": "f"}}]
    for extra, param in [
        (
            {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools.0.function.parameters",
        ),
        (
            {"messages": [{"role": "tool", "content": "4"}]},
            "messages.0",
        ),
    ]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **extra}
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_malformed_json_oversized_body_and_auth(server):
    r = post(server, "/v1/completions", b'{"model": "x", "prompt": ')
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    big = json.dumps({"model": MODEL, "prompt": "a" * (2 << 20)}).encode()
    r = post(server, "/v1/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert (
        post(server, "/v1/completions", {"model": MODEL, "prompt": "a"}, key=None).status_code
        == 401
    )
    assert (
        post(server, "/v1/completions", {"model": MODEL, "prompt": "a"}, key="sk-wrong").status_code
        == 401
    )
    # The key is checked first (as vLLM's --api-key), /v1/models included.
    assert post(server, "/v1/completions", b'{"model": ', key=None).status_code == 401
    models = httpx.get(f"{server}/v1/models", timeout=10)
    assert models.status_code == 401 and models.json()["error"]["code"] == "missing_api_key"
    assert (
        httpx.get(
            f"{server}/v1/models", headers={"Authorization": "bearer sk-standard"}, timeout=10
        ).status_code
        == 200
    )
    # A key may lower its urgency, never raise it.
    r = post(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "max_tokens": 2},
        key="sk-standard",
        **{"x-iterserve-class": "interactive"},
    )
    assert r.status_code == 403 and r.json()["error"]["param"] == "x-iterserve-class"
    r = post(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "max_tokens": 2, "priority": 0},
        key="sk-standard",
    )
    assert r.status_code == 403 and r.json()["error"]["param"] == "priority"
    r = post(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "max_tokens": 2},
        key="sk-standard",
        **{"x-iterserve-class": "batch"},
    )
    assert r.status_code == 200 and r.headers["x-iterserve-class"] == "batch"
    # The server is healthy after all of that.
    out = app.client(server).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0
    )
    assert out.choices[0].finish_reason == "length"


def test_inputs_that_once_stopped_the_engine(server):
    """Each of these once ended in a 500, or stopped the engine for every request after:
    each gets a 400 naming what is wrong, or an answer, and a normal request still works
    after them all."""
    model = json.dumps(MODEL)
    chat = '{"model": ' + model + ', "messages": [{"role": "user", "content": "hi \\ud800"}]}'
    for raw in (
        chat,
        '{"model": ' + model + ', "prompt": "hi \\uDFFF there"}',
        '{"model": "x", "metadata": ' + "[" * 100_000 + "]" * 100_000 + "}",
    ):
        r = post(
            server, "/v1/chat/completions" if "messages" in raw else "/v1/completions", raw.encode()
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    for body, param in [
        ({"prompt": [-1, 5]}, "prompt"),
        ({"prompt": [2**63]}, "prompt"),
        ({"prompt": "a", "temperature": 1, "seed": 2**64}, "seed"),
    ]:
        r = post(server, "/v1/completions", {"model": MODEL, "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    greedy = (
        app.client(server)
        .completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
        .choices[0]
        .text
    )
    for extreme in ({"temperature": 1e-38}, {"temperature": 2, "top_p": 1e-50}):
        out = app.client(server).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, **extreme
        )
        assert out.choices[0].text == greedy, extreme  # both leave only the top token


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_blocks(server, stream):
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 2000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }
    headers = {"Authorization": "Bearer sk-standard"}
    aborted = _aborted(server)
    start = time.monotonic()
    if stream:
        with httpx.stream(
            "POST", f"{server}/v1/completions", json=body, headers=headers, timeout=60
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [line for line, _ in zip((x for x in lines if x.startswith("data:")), range(3))]
            assert len(got) == 3
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server}/v1/completions", json=body, headers=headers, timeout=2.0)
    # 2000 tokens would take minutes: idle within seconds means the request was aborted.
    freed_s = app.wait_idle(server, timeout_s=15)
    assert time.monotonic() - start < 30, freed_s
    assert _aborted(server) == aborted + 1  # counted as aborted, neither finished nor failed


def _aborted(url: str) -> float:
    """``iterserve:request_aborted_total`` of the standard class."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("iterserve:request_aborted_total{")
        and 'traffic_class="standard"' in line
    )
