"""Ingress pieces without a cluster: tenants, held admission, the service config."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from deploy.config import ServiceConfig
from engine.core.params import RequestOutputKind
from policies import DEFAULT_CLASSES, LoadSnapshot, PriorityPolicy
from router.admission import AdmissionRejected, IngressAdmission
from router.errors import ApiError
from router.tenants import ApiKeyConfig, authenticate, resolve_caller

KEYS = {
    "k-int": ApiKeyConfig(tenant="a", traffic_class="interactive"),
    "k-batch": ApiKeyConfig(tenant="b", traffic_class="batch"),
    "k-std-urgent": ApiKeyConfig(tenant="c", traffic_class="standard", max_priority=0),
}


def uncached(snaps: list) -> Callable[[], list]:
    """Admission's view of these replicas (read at each decision), none holding any of
    the prompt in its prefix cache."""
    return lambda: [(s, 0) for s in snaps]


def test_no_keys_means_standard_and_no_key_needed():
    c = resolve_caller({}, DEFAULT_CLASSES, None, None, None)
    assert (c.tenant, c.traffic_class, c.priority) == (None, "standard", 1)
    assert resolve_caller({}, DEFAULT_CLASSES, None, "batch", None).traffic_class == "batch"
    with pytest.raises(ApiError) as e:
        resolve_caller({}, DEFAULT_CLASSES, None, "interactive", None)
    assert e.value.status == 403


def test_key_gives_class_and_ceiling():
    c = resolve_caller(KEYS, DEFAULT_CLASSES, "Bearer k-int", None, None)
    assert (c.tenant, c.traffic_class, c.priority) == ("a", "interactive", 0)
    # Lowering urgency is allowed, by header or field.
    assert resolve_caller(KEYS, DEFAULT_CLASSES, "Bearer k-int", "batch", None).priority == 2
    assert resolve_caller(KEYS, DEFAULT_CLASSES, "Bearer k-int", None, 5).priority == 5
    # A ceiling above the class default lets a standard key ask for priority 0.
    assert resolve_caller(KEYS, DEFAULT_CLASSES, "Bearer k-std-urgent", None, 0).priority == 0
    for header, prio in [("interactive", None), (None, 1)]:
        with pytest.raises(ApiError) as e:
            resolve_caller(KEYS, DEFAULT_CLASSES, "Bearer k-batch", header, prio)
        assert e.value.status == 403
    assert resolve_caller(KEYS, DEFAULT_CLASSES, "bearer  k-int ", None, None).tenant == "a"
    assert authenticate({}, None) is None and authenticate(KEYS, "BEARER k-batch").tenant == "b"
    for auth in [None, "Bearer nope", "Bearer ", "Basic k-int"]:
        with pytest.raises(ApiError) as e:
            resolve_caller(KEYS, DEFAULT_CLASSES, auth, None, None)
        assert e.value.status == 401
    with pytest.raises(ApiError) as e:
        resolve_caller(KEYS, DEFAULT_CLASSES, "Bearer k-int", "vip", None)
    assert e.value.status == 400 and e.value.param == "x-iterserve-class"


def _snap(running: int = 0, waiting_tokens: int = 0) -> LoadSnapshot:
    return LoadSnapshot(
        max_num_batched_tokens=512,
        max_num_seqs=64,
        num_kv_blocks_free=1000,
        running_seqs={"standard": running},
        waiting_prefill_tokens={"standard": waiting_tokens},
        waiting_requests={"standard": 1 if waiting_tokens else 0},
        step_coefficients=(0.05, 0.002, 0.002),
    )


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def test_admit_at_once_on_an_idle_replica_and_without_stats():
    adm = IngressAdmission(DEFAULT_CLASSES, policy=PriorityPolicy())
    assert await adm.admit(lambda: [(_snap(), 0)], "standard", 10, 16, 1, adm.clock()) < 0.1
    assert await adm.admit(lambda: [], "standard", 10, 16, 1, adm.clock()) < 0.1
    assert adm.held == {}


async def test_held_until_load_drops_then_admitted():
    adm = IngressAdmission(DEFAULT_CLASSES, policy=PriorityPolicy())
    loads = [_snap(waiting_tokens=100_000)]  # ~200 s of prefill ahead: over the TTFT SLO
    task = asyncio.create_task(adm.admit(uncached(loads), "standard", 10, 16, 1, adm.clock()))
    await asyncio.sleep(0.2)
    assert not task.done() and adm.held == {"standard": 1}
    loads[:] = [_snap()]  # the queue drained
    assert await asyncio.wait_for(task, 2) >= 0.2
    assert adm.held == {}


async def test_earlier_held_requests_count_ahead_with_their_prompts():
    adm = IngressAdmission(DEFAULT_CLASSES, policy=PriorityPolicy())
    # 600 tokens queued: a fresh request is admitted (TTFT about 1.3 s of the 5 s SLO).
    loads = [_snap(waiting_tokens=600)]
    assert await adm.admit(uncached(loads), "standard", 10, 16, 1, adm.clock()) < 0.1
    # Requests held since earlier with 1800 prompt tokens would go first: over the SLO
    # together (TTFT 5.07 s), so a later one is held too ...
    earlier = [adm.hold("standard", 0.0, 900), adm.hold("standard", 0.0, 900)]
    task = asyncio.create_task(adm.admit(uncached(loads), "standard", 10, 16, 1, adm.clock()))
    await asyncio.sleep(0.2)
    assert not task.done()
    # ... until they are sent on.
    for token in earlier:
        adm.release(token)
    assert await asyncio.wait_for(task, 2) >= 0.2


async def test_an_admitted_request_on_its_way_counts_ahead_of_earlier_arrivals_too():
    # One seat left. A later arrival is admitted and is on its way to the replica, whose
    # snapshot does not show it yet: an earlier arrival decided meanwhile has no seat.
    clock = FakeClock()
    adm = IngressAdmission(DEFAULT_CLASSES, policy=PriorityPolicy(), clock=clock)
    loads = [_snap(running=63)]
    later = adm.hold("standard", 2.0, 10)
    assert await adm.admit(uncached(loads), "standard", 10, 16, 1, 2.0, token=later) == 0.0
    earlier = adm.hold("standard", 1.0, 10)
    task = asyncio.create_task(
        adm.admit(uncached(loads), "standard", 10, 16, 1, 1.0, token=earlier)
    )
    await asyncio.sleep(0.2)
    assert not task.done()
    d = adm.decide(uncached(loads)(), "standard", 10, 16, 1, 1.0)
    assert d.reason.endswith("no seat (1 queued ahead, max_num_seqs 64)"), d
    # Queued at the replica, it shows in the snapshot instead; the seat is still taken.
    loads[0] = _snap(running=64)
    adm.release(later)
    await asyncio.sleep(0.2)
    assert not task.done()
    # A seat frees up: the earlier arrival goes.
    loads[0] = _snap(running=63)
    await asyncio.wait_for(task, 2)
    adm.release(earlier)
    assert adm.held == {}


async def test_held_requests_count_ahead_only_the_prompt_tokens_a_replica_would_compute():
    adm = IngressAdmission(DEFAULT_CLASSES, policy=PriorityPolicy())
    # Two earlier requests held behind ~200 s of queue; every replica holds 800 of their
    # 900 prompt tokens in its prefix cache.
    busy = [(_snap(waiting_tokens=100_000), 800)]
    earlier = [
        asyncio.create_task(
            adm.admit(lambda: list(busy), "standard", 900, 16, 1, adm.clock() - 0.5)
        )
        for _ in range(2)
    ]
    await asyncio.sleep(0.1)
    assert adm.held == {"standard": 2}
    # A later request where 600 tokens are queued: 2 x 100 tokens held ahead of it fit
    # its SLO, where 2 x 900 would not (the test above).
    assert (
        await adm.admit(uncached([_snap(waiting_tokens=600)]), "standard", 10, 16, 1, adm.clock())
        < 0.1
    )
    # Where one replica caches none of their prompts, they count whole again.
    busy.append((_snap(waiting_tokens=100_000), 0))
    await asyncio.sleep(0.1)
    later = asyncio.create_task(
        adm.admit(uncached([_snap(waiting_tokens=600)]), "standard", 10, 16, 1, adm.clock())
    )
    await asyncio.sleep(0.2)
    assert not later.done()
    for task in (*earlier, later):
        task.cancel()
    await asyncio.gather(*earlier, later, return_exceptions=True)
    assert adm.held == {}


async def test_rejected_after_max_queue_wait_with_retry_after_but_batch_waits():
    clock = FakeClock()
    adm = IngressAdmission(DEFAULT_CLASSES, policy=PriorityPolicy(), clock=clock)
    busy = [_snap(waiting_tokens=100_000)]
    clock.t = DEFAULT_CLASSES["standard"].max_queue_wait_s + 0.1  # arrived at 0
    with pytest.raises(AdmissionRejected) as e:
        await adm.admit(uncached(busy), "standard", 10, 16, 1, 0.0)
    assert e.value.retry_after_s >= 1 and "TTFT" in e.value.reason
    clock.t = 1000.0  # long past batch's max_queue_wait_s: batch is held, not refused
    task = asyncio.create_task(adm.admit(uncached(busy), "batch", 10, 16, 2, 0.0))
    await asyncio.sleep(0.2)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert adm.held == {}  # a client that left is no longer counted


async def test_rejection_after_a_hold_says_what_held_it():
    # The last failure after a hold is often only a spent TTFT budget; the 429 must also
    # say why the request was held in the first place.
    clock = FakeClock()
    adm = IngressAdmission(DEFAULT_CLASSES, policy=PriorityPolicy(), clock=clock)
    busy = [_snap(waiting_tokens=100_000)]
    task = asyncio.create_task(adm.admit(uncached(busy), "standard", 10, 16, 1, 0.0))
    await asyncio.sleep(0.1)
    assert not task.done()
    clock.t = DEFAULT_CLASSES["standard"].max_queue_wait_s + 0.1
    with pytest.raises(AdmissionRejected) as e:
        await asyncio.wait_for(task, 2)
    held = f"held {clock.t:.1f} s; first held because standard: predicted TTFT"
    assert held in e.value.reason and "of the budget" in e.value.reason
    assert adm.held == {}


async def test_admission_off_admits_everything():
    adm = IngressAdmission(DEFAULT_CLASSES, policy=PriorityPolicy(), enabled=False)
    assert (
        await adm.admit(lambda: [(_snap(waiting_tokens=10**7), 0)], "standard", 10, 16, 1, 0.0)
        == 0.0
    )


def test_service_config_yaml_and_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        yaml.safe_dump(
            {"num_replicas": 3, "engine": {"max_num_seqs": 8}, "api_keys": {"k": {"tenant": "t"}}}
        )
    )
    c = ServiceConfig.load(f, num_replicas=2, port=None)
    assert c.num_replicas == 2 and c.port == 8000  # a flag wins; an unset flag does not
    assert c.engine_config().max_num_seqs == 8 and c.model_name() == "SmolLM2-135M-Instruct"
    # A partial engine section keeps the server's policy and TPOT guard.
    assert c.engine_config().policy == "priority" and c.engine_config().tpot_slo_guard
    with pytest.raises(ValueError, match="unknown traffic_class"):
        ServiceConfig(api_keys={"k": {"tenant": "t", "traffic_class": "vip"}})
    with pytest.raises(ValueError, match="max_num_seqs"):
        ServiceConfig(engine={"max_num_seqs": 0})
    with pytest.raises(ValueError, match="top level"):
        ServiceConfig(engine={"model": "x"})
    # Engine flags (--quantization, --kv-cache-dtype) merge over the file's engine section.
    c = ServiceConfig.load(f, engine={"quantization": "none", "kv_cache_dtype": None})
    assert c.engine.quantization == "none" and c.engine.max_num_seqs == 8
    assert c.engine.kv_cache_dtype == "auto"


def test_serve_takes_the_engines_weight_flags():
    from deploy.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "--quantization", "int4", "--kv-cache-dtype", "float16"]
    )
    assert (args.quantization, args.kv_cache_dtype) == ("int4", "float16")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "fp8"])


def test_api_keys_file_adds_keys_and_refuses_bad_files(tmp_path):
    f = tmp_path / "keys.yaml"
    f.write_text(yaml.safe_dump({"sk-b": {"tenant": "b", "traffic_class": "batch"}}))
    c = ServiceConfig(api_keys={"sk-a": {"tenant": "a"}}, api_keys_file=str(f))
    keys = c.all_api_keys()
    assert sorted(keys) == ["sk-a", "sk-b"] and keys["sk-b"].traffic_class == "batch"
    with pytest.raises(ValueError, match="1 keys also in api_keys"):
        ServiceConfig(api_keys={"sk-b": {"tenant": "x"}}, api_keys_file=str(f)).all_api_keys()
    f.write_text(yaml.safe_dump({"sk-c": {"tenant": "c", "class": "batch"}}))
    with pytest.raises(ValueError, match="class"):
        c.all_api_keys()
    with pytest.raises(ValueError, match="missing.yaml"):
        ServiceConfig(api_keys_file=str(tmp_path / "missing.yaml")).all_api_keys()


def test_serve_config_yaml_builds_a_valid_service_config():
    doc = yaml.safe_load((Path(__file__).parent.parent / "deploy/serve_config.yaml").read_text())
    (app,) = doc["applications"]
    assert app["import_path"] == "deploy.app:app_builder"
    config = ServiceConfig(**app["args"])
    assert config.num_replicas == 2 and config.engine_config().policy == "priority"


def test_service_config_declared_slos_keep_server_defaults_and_cpus_are_split(monkeypatch):
    import deploy.config

    monkeypatch.setattr(deploy.config, "host_cpus", lambda: 4)
    c = ServiceConfig(engine={"traffic_classes": {"standard": {"tpot_slo_s": 0.25}}})
    e = c.engine_config()
    assert e.policy == "priority" and e.tpot_slo_guard
    assert c.traffic_classes()["standard"].tpot_slo_s == 0.25
    assert c.replica_num_cpus == 4.0  # one replica takes every core
    assert ServiceConfig(num_replicas=3).replica_num_cpus == 1.0
    assert ServiceConfig(num_replicas=2, replica_num_cpus=1.5).replica_num_cpus == 1.5
    assert ServiceConfig(engine={"policy": "fcfs"}).engine_config().tpot_slo_guard


def test_classes_and_policy_travel_as_json_and_come_back_the_same():
    # Serve's router arguments must be JSON; what build_app sends must rebuild exactly.
    import dataclasses
    import json

    from engine.config import EngineConfig
    from policies import make_classes, policy_from_spec

    c = ServiceConfig(
        engine={
            "traffic_classes": {
                "standard": {"tpot_slo_s": 0.25},
                "gold": {
                    "ttft_slo_s": 0.5,
                    "tpot_slo_s": 0.05,
                    "default_priority": -1,
                    "max_queue_wait_s": 0.2,
                },
            }
        }
    )
    sent = json.loads(
        json.dumps({n: dataclasses.asdict(t) for n, t in c.traffic_classes().items()})
    )
    assert make_classes(sent) == c.traffic_classes()
    spec = json.loads(
        json.dumps(EngineConfig(policy="priority", aging_s_per_level=5.0).policy_spec())
    )
    policy = policy_from_spec(spec)
    assert policy.by_priority and policy.aging_s_per_level == 5.0
    assert not policy_from_spec({"name": "fcfs", "options": {}}).by_priority


def test_request_limits_are_one_rule_for_ingress_and_engine():
    from policies.limits import RequestLimits, RequestRejectedError

    lim = RequestLimits(max_model_len=100, kv_capacity_tokens=80, max_num_batched_tokens=32)
    assert lim.check(30, 50) == 50 and lim.fits(30, 50)  # exactly the KV cache
    with pytest.raises(RequestRejectedError, match="KV cache capacity of 80") as e:
        lim.check(30, 51)
    assert (e.value.num_tokens, e.value.limit) == (81, 80)
    assert lim.check(30, None) == 50  # None: up to the tighter of context and cache
    assert not lim.fits(80, None)
    unchunked = RequestLimits(100, 80, 32, chunked_prefill=False)
    assert unchunked.fits(16, 16) and not unchunked.fits(16, 17)


def test_every_field_is_honoured_or_refused_by_name():
    from router import openai_format as fmt
    from router.schemas import ChatCompletionRequest, CompletionRequest

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for body, param in [
        (
            {**chat, "tools": [{"type": "function", "function": {"name": "f g"}}]},
            "tools.0.function.name",
        ),
        (
            {**chat, "tools": [{"type": "function", "function": {"name": "f", "x": 1}}]},
            "tools.0.function.x",
        ),
        (
            {
                **chat,
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}
                ],
            },
            "tools.0.function.parameters",
        ),
        ({**chat, "functions": [{"name": "f"}]}, "functions"),
        ({**chat, "response_format": {"type": "regex"}}, "response_format.type"),
        ({**chat, "response_format": {"type": "json_schema"}}, "response_format"),
        ({**chat, "tool_choice": "sometimes"}, "tool_choice"),
        ({**chat, "frobnicate": 1}, "frobnicate"),
        ({**chat, "presence_penalty": 2.5}, "presence_penalty"),
        ({**chat, "logit_bias": {"abc": 1}}, "logit_bias"),
        ({**chat, "logit_bias": {"5": 150}}, "logit_bias"),
        (
            {**chat, "stream": True, "stream_options": {"include_usage": True, "x": 1}},
            "stream_options.x",
        ),
        ({**chat, "seed": 2**64}, "seed"),
    ]:
        with pytest.raises(ApiError) as e:
            fmt.validate(body, ChatCompletionRequest)
        assert (e.value.status, e.value.param) == (400, param), body
        assert param.split(".")[-1] in str(e.value)
    for name in ("suffix", "best_of"):
        bad = {"model": "m", "prompt": "x", name: {"suffix": "!", "best_of": 3}[name]}
        with pytest.raises(ApiError, match=f"`{name}` is not supported") as e:
            fmt.validate(bad, CompletionRequest)
        assert e.value.param == name
    with pytest.raises(ApiError, match="`echo` is not supported") as e:
        fmt.validate({**chat, "echo": True}, ChatCompletionRequest)
    turn = {
        "role": "assistant",
        "content": "hi",
        "refusal": None,
        "tool_calls": None,
        "annotations": [],
        "audio": None,
        "function_call": None,
    }  # as clients echo it
    fmt.validate({**chat, "messages": [*chat["messages"], turn]}, ChatCompletionRequest)
    for extra in (
        {"name": "bob"},
        {"tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]},
        {"tool_call_id": "1"},
        {"colour": "red"},
    ):
        msg = {**chat["messages"][0], **extra}
        with pytest.raises(ApiError) as e:
            fmt.validate({**chat, "messages": [msg]}, ChatCompletionRequest)
        assert e.value.status == 400 and next(iter(extra)) in str(e.value), extra
    many = fmt.validate(
        {"model": "m", "prompt": ["a", "b"], "echo": True, "logprobs": 2, "max_tokens": 0},
        CompletionRequest,
    )
    assert many.prompt == ["a", "b"] and fmt.scores_only(many, chat=False)
    scored = fmt.sampling_params(many, chat=False)
    assert scored.max_tokens == 1 and scored.prompt_logprobs == 2


def test_default_values_and_fields_that_change_nothing_are_accepted():
    from router import openai_format as fmt
    from router.schemas import ChatCompletionRequest

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ApiError, match="`verbosity` is not supported"):
        fmt.validate({**chat, "verbosity": "low"}, ChatCompletionRequest)
    ok = fmt.validate(
        {
            **chat,
            "tools": [],
            "response_format": {"type": "text"},
            "user": "u",
            "safety_identifier": "s",
            "prompt_cache_key": "k",
            "verbosity": None,
            "stream": True,
            "temperature": None,
            "n": None,
            "stream_options": {"include_usage": True, "include_obfuscation": False},
            "metadata": {"a": "b"},
            "store": False,
            "service_tier": "auto",
            "logit_bias": {"42": -5},
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "stop_token_ids": [7],
            "frequency_penalty": 0.5,
            "presence_penalty": -0.5,
        },
        ChatCompletionRequest,
    )
    params = fmt.sampling_params(ok, chat=True)
    assert (ok.temperature, ok.n) == (1.0, 1)  # null asks for the default, as OpenAI's
    assert params.logit_bias == {42: -5} and params.top_k == 5
    assert (params.min_p, params.repetition_penalty, params.min_tokens) == (0.1, 1.1, 2)
    assert (params.frequency_penalty, params.presence_penalty) == (0.5, -0.5)
    assert params.stop_token_ids == [7] and params.json_schema is None
    assert params.output_kind is RequestOutputKind.DELTA  # what a replica's step items carry
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for fmt_, want in [
        ({"type": "json_object"}, {"type": "object"}),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
            schema,
        ),
    ]:
        got = fmt.validate({**chat, "response_format": fmt_}, ChatCompletionRequest)
        assert fmt.sampling_params(got, chat=True).json_schema == want


@pytest.mark.parametrize(
    "extra,param,message",
    [
        (
            {"max_tokens": 2, "min_tokens": 3},
            "min_tokens",
            "SamplingParams.min_tokens=3: must be >= 0 and <= max_tokens",
        ),
        (
            {"response_format": {"type": "json_object"}, "ignore_eos": True},
            "json_schema",
            "cannot be combined with ignore_eos",
        ),
    ],
)
def test_sampling_params_the_schema_lets_through_are_a_400_at_the_ingress(extra, param, message):
    # Built, and so checked, once at the ingress: the replica's engine takes them as they
    # are. The answer is the one the replica's refusal gave (status, code, field, message).
    from router import openai_format as fmt
    from router.schemas import CompletionRequest

    req = fmt.validate({"model": "m", "prompt": "a", **extra}, CompletionRequest)
    with pytest.raises(ApiError) as e:
        fmt.sampling_params(req, chat=False)
    err = e.value
    assert (err.status, err.param, err.code) == (400, param, "invalid_value")
    assert message in err.message


def test_requests_vllm_refuses_are_refused_with_a_reason():
    from router import openai_format as fmt
    from router.schemas import ChatCompletionRequest, CompletionRequest

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for body, reason in [
        ({**chat, "stream_options": {"include_usage": True}}, "`stream` is true"),
        ({**chat, "top_logprobs": 3}, "`logprobs` is true"),
        ({**chat, "messages": [{"role": "user"}]}, "content is required"),
    ]:
        with pytest.raises(ApiError, match=reason) as e:
            fmt.validate(body, ChatCompletionRequest)
        assert e.value.status == 400
    for prompt in ([-1, 5], [[5], [2**63]]):
        with pytest.raises(ApiError, match="is not a token id") as e:
            fmt.validate({"model": "m", "prompt": prompt}, CompletionRequest)
        assert (e.value.status, e.value.param) == (400, "prompt"), e.value.param
    # The param is the field's path, without the union member pydantic tried.
    for body, param in [({"stop": [1]}, "stop"), ({"prompt": [["a"]]}, "prompt")]:
        with pytest.raises(ApiError) as e:
            fmt.validate({"model": "m", "prompt": "a", **body}, CompletionRequest)
        assert e.value.param == param, e.value.param
    # null is not a value for max_tokens' default to replace: it means up to the context.
    assert (
        fmt.validate(
            {"model": "m", "prompt": "x", "max_tokens": None}, CompletionRequest
        ).max_tokens
        is None
    )


def test_a_ttft_budget_spent_while_held_is_said_so():
    from policies import AdmissionController, Reject

    adm = AdmissionController(DEFAULT_CLASSES, policy=PriorityPolicy())
    slo = DEFAULT_CLASSES["standard"].ttft_slo_s
    d = adm.decide(_snap(waiting_tokens=100_000), "standard", 10, 16, 1, waited_s=slo + 1)
    assert isinstance(d, Reject) and "passed while it was held" in d.reason, d
    assert "> -" not in d.reason


def test_a_new_traffic_class_names_the_fields_it_still_needs():
    new = {"vip": {"ttft_slo_s": 1.0, "tpot_slo_s": 0.1}}
    with pytest.raises(
        ValueError, match="'vip' is new .*give default_priority, max_queue_wait_s too"
    ):
        ServiceConfig(engine={"traffic_classes": new})
    new["vip"] |= {"default_priority": 0, "max_queue_wait_s": 1.0}
    assert ServiceConfig(engine={"traffic_classes": new}).traffic_classes()["vip"].ttft_slo_s == 1


class _Tokenizer:
    """One token per character."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


class _Engine:
    dead = False


class _Replica:
    """A replica in process (router.local.LocalReplica) whose engine answers each request
    with ``max_tokens`` steps of one token each, echoing the prompt."""

    replica_id = "fake"
    engine = _Engine()
    limits = None

    def info(self):
        from policies.limits import RequestLimits
        from router.contract import ModelInfo

        self.limits = RequestLimits(32, 1024, 64)
        return ModelInfo(_Tokenizer(), self.limits)

    async def items(self, request_id, prompt_token_ids, params, shape, send_load=True):
        from policies.limits import RequestRejectedError
        from router.contract import Accepted, Refused, SequenceDelta, StepItem

        try:
            max_tokens = self.limits.check(len(prompt_token_ids), params.max_tokens)
        except RequestRejectedError as e:
            yield Refused(str(e), "context_length_exceeded", param="prompt")
            return
        yield Accepted(len(prompt_token_ids), self.replica_id)
        for i in range(max_tokens):
            last = i == max_tokens - 1
            token = prompt_token_ids[i % len(prompt_token_ids)]
            delta = SequenceDelta(0, chr(token), [token], None, "length" if last else None, None)
            yield StepItem([delta], last, queue_s=0.0 if i == 0 else None)

    def record_routing_stats(self) -> dict:
        return {}


async def test_answer_is_what_the_api_answers():
    """``Ingress.answer`` (a batch line's path) goes through the request pipeline of
    ``POST /v1/completions``: the same body, status and error for the same request."""
    import httpx

    from router.ingress import Ingress, add_routes, make_app
    from router.local import LocalReplicas
    from router.tenants import CLASS_HEADER

    ingress = Ingress(LocalReplicas(_Replica()), {"model_name": "m", "admission": False})
    app = make_app()
    add_routes(app, ingress)
    bodies = {
        "ok": {"model": "m", "prompt": "abc", "max_tokens": 4},
        "two prompts": {"model": "m", "prompt": ["ab", "cd"], "max_tokens": 2, "n": 2},
        "bad field": {"model": "m", "prompt": "abc", "top_p": 7},
        "other model": {"model": "x", "prompt": "abc"},
        "too long": {"model": "m", "prompt": "a" * 40, "max_tokens": 1},
    }
    headers = {CLASS_HEADER: "batch"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        for name, body in bodies.items():
            resp = await client.post("/v1/completions", json=body, headers=headers)
            answer = await ingress.answer("/v1/completions", body, headers)
            assert answer.status == resp.status_code, name
            if resp.status_code != 200:
                assert answer.body == resp.json(), name
                assert answer.request_id == "" and "x-request-id" not in resp.headers
                continue
            got, want = dict(answer.body), resp.json()
            # Each request has its own id and creation time; the rest is the same.
            assert got.pop("id") == answer.request_id and answer.request_id.startswith("cmpl-")
            assert want.pop("id") == resp.headers["x-request-id"]
            got.pop("created"), want.pop("created")
            assert got == want, name
            assert answer.completion_tokens == want["usage"]["completion_tokens"] > 0
    statuses = {
        n: (await ingress.answer("/v1/completions", b, headers)).status for n, b in bodies.items()
    }
    assert statuses == {
        "ok": 200,
        "two prompts": 200,
        "bad field": 400,
        "other model": 404,
        "too long": 400,
    }
    streamed = await ingress.answer("/v1/completions", {**bodies["ok"], "stream": True}, headers)
    assert streamed.status == 400 and streamed.body["error"]["param"] == "stream"


async def test_both_apps_declare_the_bodies_their_handlers_validate():
    """The in-process server's app and Ray Serve's ingress app serve one document, which
    declares every POST body from the model that validates it; a body against it is still
    the handler's 400 in OpenAI's format, not FastAPI's 422."""
    import httpx

    import router.api
    from router.ingress import ROUTES, Ingress, add_routes, make_app
    from router.local import LocalReplicas
    from router.openapi_doc import REF, body_schemas

    ingress = Ingress(LocalReplicas(_Replica()), {"model_name": "m", "admission": False})
    app = make_app()
    add_routes(app, ingress)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        doc = (await client.get("/openapi.json")).json()
        bad = await client.post("/v1/chat/completions", json=["not", "an", "object"])
        wrong = await client.post("/v1/completions", json={"model": "m", "prompt": 3.5})
    assert doc == router.api.app.openapi()
    bodies = {path: model for method, path, _, model in ROUTES if method == "POST"}
    assert {path for path, ops in doc["paths"].items() if "post" in ops} == set(bodies)
    for path, model in bodies.items():
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] and "parameters" not in doc["paths"][path]["post"]
        assert body["content"]["application/json"]["schema"] == {
            "$ref": REF.format(model=model.__name__)
        }
    assert body_schemas(bodies.values()).items() <= doc["components"]["schemas"].items()
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "prompt"
