"""Tool calls on held schemas: how many responses end in a call, and how many calls are valid.

    python -m bench.tool_calls          # about 5 minutes on 2 cores (printed first)
    python -m bench.tool_calls --quick  # the first 6 functions only

``iterserve serve`` with its defaults (the embedded SmolLM2-135M-Instruct, its tools
rendered by the shipped Hermes template) answers one request per held function of
``tests/tool_schemas.py`` (23 functions: nested objects, enums, arrays, optional and
nullable fields, bounded numbers), each offered with two others, under
``tool_choice: required`` and under the named function, greedy, ``max_tokens`` 256, one
call each (``parallel_tool_calls: false``); once with no penalty and once with
``repetition_penalty`` 1.3. Every returned call is checked with ``jsonschema`` against its
function's ``parameters``.

A response either ends in calls (``finish_reason: tool_calls``) or runs to ``max_tokens``
(``length``): a call cut there is not returned. So the validity rate is of the calls
returned, and the completion rate says how often the model closed its call within the
budget. Writes ``bench/results/tool_calls.json`` and ``.md``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import jsonschema

from bench.toolkit import RESULTS, cli
from bench.toolkit.report import write_report
from bench.toolkit.servers import MODEL_NAME, Process, free_port
from router.tools import NO_ARGUMENTS
from tests.tool_schemas import HELD

MAX_TOKENS = 256
PENALTIES = (None, 1.3)


async def _one(client: Any, i: int, named: bool, penalty: float | None, held: list) -> dict:
    tool, ask = held[i]
    tools = [tool, held[(i + 1) % len(held)][0], held[(i + 5) % len(held)][0]]
    name = tool["function"]["name"]
    choice = {"type": "function", "function": {"name": name}} if named else "required"
    r = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": ask}],
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={} if penalty is None else {"repetition_penalty": penalty},
        extra_headers={"x-iterserve-class": "batch"},  # queued, never refused
    )
    schemas = {
        t["function"]["name"]: t["function"].get("parameters") or NO_ARGUMENTS for t in tools
    }
    out = r.choices[0]
    calls, valid = 0, 0
    for call in out.message.tool_calls or []:
        calls += 1
        try:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            valid += int(not named or call.function.name == name)
        except (ValueError, KeyError, jsonschema.ValidationError):
            pass
    return {
        "function": name,
        "finish_reason": out.finish_reason,
        "calls": calls,
        "valid": valid,
        "completion_tokens": r.usage.completion_tokens,
    }


async def _run(url: str, held: list) -> dict[str, list[dict]]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=900)
    runs = {}
    for penalty in PENALTIES:
        for named in (False, True):
            key = f"{'named' if named else 'required'}, penalty {penalty or 'none'}"
            t = time.monotonic()
            runs[key] = await asyncio.gather(
                *(_one(client, i, named, penalty, held) for i in range(len(held)))
            )
            print(f"{key}: {time.monotonic() - t:.0f} s", flush=True)
    return runs


def _summary(rows: list[dict]) -> dict[str, Any]:
    calls = sum(r["calls"] for r in rows)
    valid = sum(r["valid"] for r in rows)
    ended = sum(r["finish_reason"] == "tool_calls" for r in rows)
    return {
        "requests": len(rows),
        "ended_in_a_call": ended,
        "cut_by_max_tokens": sum(r["finish_reason"] == "length" for r in rows),
        "calls_returned": calls,
        "calls_valid": valid,
        "validity": valid / calls if calls else None,
        "completion": ended / len(rows),
        "cut": [r["function"] for r in rows if r["finish_reason"] != "tool_calls"],
    }


def table(result: dict[str, Any]) -> list[str]:
    """The result's summary as markdown table lines."""
    lines = [
        "| choice, penalty | requests | ended in a call | cut by max_tokens | calls valid |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, s in result["summary"].items():
        lines.append(
            f"| {key} | {s['requests']} | {s['ended_in_a_call']} | {s['cut_by_max_tokens']} "
            f"| {s['calls_valid']}/{s['calls_returned']} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("bench.tool_calls", __doc__)
    cli.add_quick(p, "the first 6 functions only")
    cli.add_out(p, RESULTS / "tool_calls.json", "the result JSON (and .md beside it)")
    args = p.parse_args(argv)
    held = HELD[:6] if args.quick else HELD
    cli.expected("tool_calls", 60 if args.quick else 300, f"{4 * len(held)} requests on 2 cores")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "deploy.cli", "serve", "--port", str(port)]
    with Process("iterserve", command, url):
        runs = asyncio.run(_run(url, held))
    result = {"max_tokens": MAX_TOKENS, "summary": {k: _summary(r) for k, r in runs.items()}}
    md = "# Tool calls on held schemas\n\n" + "\n".join(table(result)) + "\n"
    write_report(args.out, {**result, "runs": runs}, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
