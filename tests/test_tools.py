"""Tool calling in ``/v1/chat/completions``: the grammar (``router.tool_parsers``), the
parser and its streamed deltas, the templates (``router.tools``), and the served API with
the openai client, on the embedded SmolLM2 (whose own template has no tool support, so the
shipped Hermes template renders its tools).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator

import httpx
import jsonschema
import pytest

from deploy.config import ServiceConfig
from router.errors import ApiError
from router.schemas import ChatCompletionRequest
from router.tool_parsers import HERMES, LLAMA3_JSON, ToolCallStream, message
from router.tools import NO_ARGUMENTS, ChatTemplates, render, tool_use
from tests.serving_app import MODEL, free_port, running_local
from tests.tool_schemas import HELD

WEATHER = HELD[0][0]
CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "\n</tool_call>"
)


def chat(**fields) -> ChatCompletionRequest:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate(body)


# -- the parser and its stream ---------------------------------------------------------


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Just text, no call.", "Just text, no call.", []),
        ("   ", "   ", []),
        (CALL, None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
        (
            "Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"),
            "Let me check.\n\n",
            [
                ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                ("get_weather", '{"city": "Oslo", "unit": "celsius"}'),
            ],
        ),
        (
            '<tool_call>\n{"name": "f", "arguments": {"s": "a } and </tool_call> inside"}}'
            "\n</tool_call>",
            None,
            [("f", '{"s": "a } and </tool_call> inside"}')],
        ),
        # Cut by max_tokens: not a call; its text is content.
        (CALL[:40], CALL[:40], []),
        ("Before " + CALL[:-3], "Before " + CALL[:-3], []),
        # Not a call (no JSON object): text.
        ("<tool_call> oops", "<tool_call> oops", []),
    ],
)
def test_scan_reads_calls_and_content(text, content, calls):
    got = message(HERMES.scan(text, final=True))
    assert got["content"] == content
    assert [
        (c["function"]["name"], c["function"]["arguments"]) for c in got.get("tool_calls", [])
    ] == calls
    for c in got.get("tool_calls", []):
        assert isinstance(json.loads(c["function"]["arguments"]), dict)
        assert c["id"].startswith("call_") and c["type"] == "function"


def reassemble(deltas: list[dict]) -> dict:
    """A message from streamed deltas, as a client assembles it."""
    content, calls = None, []
    for d in deltas:
        if "content" in d:
            content = (content or "") + d["content"]
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(calls):
                calls.append({"id": tc["id"], "name": tc["function"]["name"], "arguments": ""})
            calls[tc["index"]]["arguments"] += tc["function"].get("arguments", "")
    return {"content": content, "calls": [(c["name"], c["arguments"]) for c in calls]}


@pytest.mark.parametrize("seed", range(6))
def test_streamed_deltas_reassemble_to_the_whole_message(seed):
    rng = random.Random(seed)
    texts = [
        "Plain answer.",
        CALL,
        "Sure.\n" + CALL + "\n" + CALL.replace("celsius", "fahrenheit"),
        CALL + "\n",
        "  \n" + CALL,
        '<tool_call>\n{"name": "f", "arguments": {"a": {"b": [1, {"c": "}"}]}, "d": "x"}}'
        "\n</tool_call>",
    ]
    for text in texts:
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 30))))
        parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = ToolCallStream(HERMES)
        deltas = [stream.feed(p, final=i == len(parts) - 1) for i, p in enumerate(parts)]
        whole = message(HERMES.scan(text, final=True))
        got = reassemble(deltas)
        expect_content = whole["content"]
        if expect_content == "" and not whole.get("tool_calls"):
            expect_content = None  # an empty delta sends no content key
        assert got["content"] == expect_content, (text, parts)
        names = [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])
        ]
        assert got["calls"] == names, (text, parts)
        # The name comes first, on its own, then argument fragments.
        firsts = [tc for d in deltas for tc in d.get("tool_calls", []) if "id" in tc]
        assert all(tc["function"]["arguments"] == "" for tc in firsts)
        assert len({tc["id"] for tc in firsts}) == len(firsts)


def test_llama3_json_calls_are_read_and_streamed():
    text = (
        'Sure. {"name": "f", "parameters": {"a": [1, {"b": "}"}]}}; {"name": "g", "parameters": {}}'
    )
    whole = message(LLAMA3_JSON.scan(text, final=True))
    assert whole["content"] == "Sure. ; "
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    assert calls == [("f", '{"a": [1, {"b": "}"}]}'), ("g", "{}")]
    stream = ToolCallStream(LLAMA3_JSON)
    deltas = [stream.feed(ch, final=i == len(text) - 1) for i, ch in enumerate(text)]
    assert reassemble(deltas) == {"content": "Sure. ; ", "calls": calls}
    other_key = message(LLAMA3_JSON.scan('{"name": "f", "arguments": {"x": 1}}', True))
    assert other_key["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'


def test_a_call_cut_by_max_tokens_is_content_once_the_stream_ends():
    stream = ToolCallStream(HERMES)
    first = stream.feed(CALL[:60], final=False)
    assert first["tool_calls"][0]["function"]["name"] == "get_weather"
    last = stream.feed("", final=True)
    assert "tool_calls" not in last and last["content"] == CALL[:60]


# -- the grammar -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def structured(tokenizer):
    from engine.model.structured import StructuredOutput

    return StructuredOutput(tokenizer, len(tokenizer))


def accepts(structured, tokenizer, tag: dict, text: str, end: bool = True) -> bool:
    import xgrammar as xgr

    m = xgr.GrammarMatcher(structured.compile_tag(tag))
    return m.accept_string(text) and (not end or m.accept_token(tokenizer.eos_token_id))


def test_the_grammar_admits_exactly_what_tool_choice_allows(structured, tokenizer):
    tools = [("get_weather", WEATHER["function"]["parameters"]), ("f", NO_ARGUMENTS)]
    ok_call = CALL
    other = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    auto = HERMES.structural_tag(tools, "auto", True)
    required = HERMES.structural_tag(tools, "required", True)
    single = HERMES.structural_tag(tools, "required", False)
    named = HERMES.structural_tag(tools[:1], "named", True)
    a = lambda tag, text, end=True: accepts(structured, tokenizer, tag, text, end)  # noqa: E731
    assert a(auto, "No call needed.") and a(auto, "Checking.\n" + ok_call)
    assert a(auto, ok_call + "\n" + other)
    # a started call must be valid: unknown function, bad enum, missing field, whitespace
    assert not a(auto, '<tool_call>\n{"name": "nope"', end=False)
    assert not a(auto, ok_call.replace("celsius", "kelvin"), end=False)
    assert not a(auto, ok_call.replace(', "unit": "celsius"', ""), end=False)
    assert not a(auto, ok_call.replace('{"city"', '{  "city"'), end=False)
    assert a(required, ok_call) and a(required, ok_call + "\n" + other)
    assert not a(required, "Text first", end=False) and not a(required, "")
    assert a(single, ok_call) and not a(single, ok_call + "\n" + other)
    assert a(named, ok_call) and not a(named, other, end=False)
    llama = LLAMA3_JSON.structural_tag(tools, "required", True)
    llama_call = '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}'
    assert a(llama, llama_call) and a(llama, llama_call + '; {"name": "f", "parameters": {}}')
    assert not a(llama, CALL, end=False)


def test_tool_choice_refusals_name_the_field():
    for fields, param in [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tools"),
    ]:
        with pytest.raises(ApiError) as e:
            tool_use(chat(**fields), "hermes")
        assert (e.value.status, e.value.param) == (400, param)
    assert tool_use(chat(tools=[WEATHER], tool_choice="none"), "hermes") is None
    assert tool_use(chat(), "hermes") is None
    use = tool_use(chat(tools=[WEATHER]), "hermes")
    assert use is not None and use.mode == "auto" and use.parallel


# -- the templates ---------------------------------------------------------------------


def test_the_shipped_template_renders_tools_calls_and_answers(tokenizer):
    templates = ChatTemplates.of(tokenizer, None)
    assert templates.describe() == "hermes (shipped)"  # SmolLM2's own has no tools
    args = '{"city": "Paris", "unit": "celsius"}'
    req = chat(
        tools=[WEATHER],
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": args},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 18}'},
        ],
    )
    text = render(req, tool_use(req, "hermes"), tokenizer, templates)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n")
    assert json.dumps(WEATHER["function"]) in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' + args in text
    )
    assert '<|im_start|>user\n<tool_response>\n{"temp": 18}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")
    # Without tools (and with tool_choice none) the model's own template renders as before.
    plain = chat(messages=[{"role": "user", "content": "Hello"}])
    own = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
    )
    assert render(plain, None, tokenizer, templates) == own
    none = chat(
        messages=[{"role": "user", "content": "Hello"}], tools=[WEATHER], tool_choice="none"
    )
    assert render(none, tool_use(none, "hermes"), tokenizer, templates) == own
    # A configured template renders everything.
    configured = ChatTemplates.of(tokenizer, "{{ messages[0]['content'] }}!")
    assert render(plain, None, tokenizer, configured) == "Hello!"
    assert configured.describe() == "configured"


# -- served, with the openai client ----------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with running_local(ServiceConfig(port=free_port())) as (url, _):
        yield url


def client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def valid_calls(message, tools: list[dict]) -> list[tuple[str, dict]]:
    """The message's calls, each checked against its function's schema."""
    schemas = {
        t["function"]["name"]: t["function"].get("parameters") or NO_ARGUMENTS for t in tools
    }
    out = []
    for call in message.tool_calls or []:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, schemas[call.function.name])
        out.append((call.function.name, args))
    return out


@pytest.mark.slow
def test_an_agent_round_trip_with_the_openai_client(server):
    c = client(server)
    tools = [WEATHER, HELD[7][0]]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=tools,
        tool_choice="required",
        max_tokens=128,
        temperature=0,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = valid_calls(choice.message, tools)
    assert calls and len({tc.id for tc in choice.message.tool_calls}) == len(calls)
    messages.append(choice.message.model_dump(exclude_none=True))
    for tc in choice.message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": tc.id, "content": '{"temperature_c": 18}'})
    final = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=tools,
        tool_choice="auto",
        max_tokens=48,
        temperature=0,
    )
    last = final.choices[0]
    assert last.finish_reason in ("stop", "length", "tool_calls")
    valid_calls(last.message, tools)
    assert last.message.content or last.message.tool_calls
    assert final.usage.prompt_tokens > first.usage.prompt_tokens


def stream_message(url: str, body: dict) -> dict:
    """A streamed response's message, reassembled, and its finish reason."""
    deltas, finish = [], None
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            deltas.append({k: v for k, v in choice["delta"].items() if k != "role" and v != ""})
            finish = choice["finish_reason"] or finish
    return {**reassemble(deltas), "finish_reason": finish}


@pytest.mark.slow
@pytest.mark.parametrize(
    "fields",
    [
        {"tool_choice": "required", "temperature": 0.9, "seed": 7},
        {"tool_choice": "auto", "temperature": 1.0, "seed": 3},
        {
            "tool_choice": {"type": "function", "function": {"name": "convert_currency"}},
            "temperature": 0.8,
            "seed": 11,
        },
        {"tool_choice": "required", "parallel_tool_calls": False, "temperature": 0},
    ],
)
def test_a_stream_reassembles_to_the_response(server, fields):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Rome, and 20 USD in EUR?"}],
        "tools": [WEATHER, HELD[7][0]],
        "max_tokens": 96,
        **fields,
    }
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    calls = [
        (c["function"]["name"], c["function"]["arguments"])
        for c in choice["message"].get("tool_calls", [])
    ]
    streamed = stream_message(server, body)
    assert streamed["calls"] == calls
    assert streamed["content"] == choice["message"]["content"] or (
        not streamed["content"] and not choice["message"]["content"]
    )
    assert streamed["finish_reason"] == choice["finish_reason"]
    if fields["tool_choice"] != "auto":
        assert calls and choice["finish_reason"] == "tool_calls"
    if fields.get("parallel_tool_calls") is False:
        assert len(calls) == 1


@pytest.mark.slow
def test_every_call_on_the_held_schemas_parses_and_validates(server):
    """required and named choices on the 23 held functions (each offered with two
    others): every response is one call, and every call is valid."""
    from openai import AsyncOpenAI

    aclient = AsyncOpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=300)

    async def one(i: int, named: bool):
        tool, ask = HELD[i]
        tools = [tool, HELD[(i + 1) % len(HELD)][0], HELD[(i + 5) % len(HELD)][0]]
        choice = (
            {"type": "function", "function": {"name": tool["function"]["name"]}}
            if named
            else "required"
        )
        r = await aclient.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": ask}],
            tools=tools,
            tool_choice=choice,
            max_tokens=256,
            temperature=0,
            # One call each; the penalty keeps the 135M model from looping inside a
            # string value at temperature 0, which would run to max_tokens. Validity does
            # not rest on it: the grammar admits only valid calls.
            parallel_tool_calls=False,
            extra_body={"repetition_penalty": 1.3},
            # batch: admission queues the 46 at once rather than refuse them
            extra_headers={"x-iterserve-class": "batch"},
        )
        return r.choices[0], tools, tool["function"]["name"] if named else None

    async def run():
        return await asyncio.gather(
            *(one(i, named) for i in range(len(HELD)) for named in (False, True))
        )

    results = asyncio.run(run())
    assert len(results) == 2 * len(HELD) >= 40
    for choice, tools, wanted in results:
        assert choice.finish_reason == "tool_calls", choice
        calls = valid_calls(choice.message, tools)
        assert calls
        if wanted is not None:
            assert [name for name, _ in calls] == [wanted]


@pytest.mark.slow
def test_refusals_and_the_models_card(server):
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    for extra, param in [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"ignore_eos": True}, "tools"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}
                ]
            },
            "tools.0.function.parameters",
        ),
    ]:
        r = httpx.post(f"{server}/v1/chat/completions", json={**base, **extra}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    cut = httpx.post(
        f"{server}/v1/chat/completions",
        json={**base, "tool_choice": "required", "max_tokens": 6, "temperature": 0},
        timeout=60,
    ).json()["choices"][0]
    assert cut["finish_reason"] == "length" and "tool_calls" not in cut["message"]
    assert cut["message"]["content"].startswith("<tool_call>")
    card = httpx.get(f"{server}/v1/models").json()["data"][0]
    assert (card["chat_template"], card["tool_call_parser"]) == ("hermes (shipped)", "hermes")
    assert httpx.get(f"{server}/health").status_code == 200
