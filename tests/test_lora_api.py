"""LoRA adapters through the API: chosen by ``model``, listed by ``/v1/models``, limited per
API key, loaded and unloaded at run time, counted under their own ``model`` label.

One in-process server (``iterserve serve``'s) for the module, with one adapter configured
at start and a second loaded by a test; the greedy text of each equals transformers'
``generate`` on the model merged with it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import httpx
import pytest

from deploy.config import ServiceConfig
from deploy.top import scrape
from router.ingress import Ingress, add_routes, make_app
from tests.serving_app import MODEL, free_port, running_local
from tests.test_generation import greedy_reference

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MAX_TOKENS = 8
ADMIN, USER, LIMITED = "sk-admin", "sk-user", "sk-limited"


@pytest.fixture(scope="module")
def adapters(lora_dirs, model_dir, tokenizer) -> dict[str, tuple[str, str]]:
    """test_lora's two adapters (conftest's ``lora_dirs``) under the names ``qv`` (A) and
    ``all`` (B): name -> (directory, its greedy text for :data:`PROMPT`); and the base
    model's text under :data:`MODEL`."""
    ids = tokenizer.encode(PROMPT)
    out = {}
    for name, source in (("qv", "A"), ("all", "B")):
        [(ref, _)] = greedy_reference(model_dir, [ids], MAX_TOKENS, adapter=lora_dirs[source])
        out[name] = (lora_dirs[source], tokenizer.decode(ref))
    [(ref, _)] = greedy_reference(model_dir, [ids], MAX_TOKENS)
    out[MODEL] = ("", tokenizer.decode(ref))
    assert len({text for _, text in out.values()}) == 3, out  # each adapter changes the text
    return out


@pytest.fixture(scope="module")
def server(adapters) -> Iterator[str]:
    config = ServiceConfig(
        port=free_port(),
        api_keys={
            ADMIN: {"tenant": "ops", "admin": True},
            USER: {"tenant": "a"},
            LIMITED: {"tenant": "b", "adapters": ["qv"]},
        },
        lora_adapters={"qv": adapters["qv"][0]},
        allow_runtime_lora_updates=True,
        engine={"num_kv_blocks": 128},
    )
    with running_local(config) as (url, _):
        yield url


def post(url: str, path: str, body: dict, key: str = USER) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120)


def complete(url: str, model: str, key: str = USER) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    return post(url, "/v1/completions", body, key)


def models(url: str) -> dict[str, dict]:
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {USER}"})
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


def test_the_openai_client_chooses_an_adapter_by_model(server, adapters):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key=USER)
    listed = {m.id for m in client.models.list()}
    assert listed == {MODEL, "qv"}
    for model in (MODEL, "qv"):
        out = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
        assert out.model == model
        assert out.choices[0].text == adapters[model][1], model


def test_models_lists_each_adapter_with_its_parent(server, adapters):
    listed = models(server)
    assert listed["qv"]["parent"] == MODEL and listed["qv"]["root"] == adapters["qv"][0]
    assert listed[MODEL]["parent"] is None


def test_a_key_limited_to_some_adapters_gets_403_for_the_others(server, adapters):
    assert complete(server, "qv", LIMITED).json()["choices"][0]["text"] == adapters["qv"][1]
    assert complete(server, MODEL, LIMITED).status_code == 200
    r = post(
        server,
        "/v1/load_lora_adapter",
        {"lora_name": "all", "lora_path": adapters["all"][0]},
        ADMIN,
    )
    assert r.status_code == 200, r.text
    try:
        r = complete(server, "all", LIMITED)
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert "'all'" in err["message"] and err["param"] == "model"
        assert complete(server, "all", USER).status_code == 200
    finally:
        assert (
            post(server, "/v1/unload_lora_adapter", {"lora_name": "all"}, ADMIN).status_code == 200
        )


def test_an_adapter_loaded_and_unloaded_at_run_time(server, adapters):
    path, text = adapters["all"]
    r = complete(server, "all")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    body = {"lora_name": "all", "lora_path": path}
    r = post(server, "/v1/load_lora_adapter", body, USER)  # not an admin key
    assert r.status_code == 403, r.text
    r = post(server, "/v1/load_lora_adapter", body, ADMIN)
    assert r.status_code == 200 and "added successfully" in r.text
    assert models(server)["all"]["parent"] == MODEL
    assert complete(server, "all").json()["choices"][0]["text"] == text
    # The same name again, or the base model's: 400.
    for name in ("all", MODEL):
        r = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, ADMIN)
        assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    # Counted under its own model label.
    key = ("iterserve:generation_tokens_total", (("model", "all"), ("traffic_class", "standard")))
    assert scrape(server, timeout_s=10)[key] > 0
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "all"}, ADMIN)
    assert r.status_code == 200 and "removed successfully" in r.text
    assert "all" not in models(server)
    assert complete(server, "all").status_code == 404
    assert not any(("model", "all") in labels for _, labels in scrape(server, timeout_s=10))
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "all"}, ADMIN)
    assert r.status_code == 404


def test_a_bad_adapter_gets_400_and_disturbs_nothing(server, adapters, tmp_path):
    (tmp_path / "empty").mkdir()
    dora = tmp_path / "dora"
    dora.mkdir()
    src = adapters["qv"][0]
    shutil.copy(f"{src}/adapter_model.safetensors", dora)
    config = json.load(open(f"{src}/adapter_config.json"))
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    cases = {
        str(tmp_path / "missing"): "is not a directory",
        str(tmp_path / "empty"): "adapter_config.json is missing",
        str(dora): "DoRA is not supported",
    }
    for path, why in cases.items():
        r = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path}, ADMIN)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert why in err["message"] and err["param"] == "lora_path", err
    r = post(server, "/v1/load_lora_adapter", {"lora_path": src}, ADMIN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    assert set(models(server)) == {MODEL, "qv"}
    assert complete(server, "qv").json()["choices"][0]["text"] == adapters["qv"][1]
    assert httpx.get(f"{server}/health").status_code == 200


class _NoReplicas:
    """Replicas that must not be reached."""

    def __getattr__(self, name: str):
        def reached(*args, **kwargs):
            raise AssertionError(f"the replicas were reached ({name})")

        return reached


async def test_runtime_updates_are_404_unless_enabled():
    ingress = Ingress(_NoReplicas(), {"model_name": MODEL})
    app = make_app()
    add_routes(app, ingress)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = await client.post(path, json={"lora_name": "x", "lora_path": "/x"})
            assert r.status_code == 404, r.text
            assert "allow_runtime_lora_updates" in r.json()["error"]["message"]
