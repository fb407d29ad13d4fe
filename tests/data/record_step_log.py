"""Record tests/data/step_log_small.jsonl: a light load through the real HTTP path.

Starts ``iterserve serve --step-log FILE`` (the embedded model, admission on, the server's
defaults) on a spare port, sends a fixed schedule of completions (token-id prompts unique
from their first token, ``ignore_eos``, classes standard and batch; single requests with
idle gaps between them and bursts of two to four), waits for every answer and stops the
server. ``tests/test_step_log.py`` replays the file step for step.

No two requests arrive at the same instant: the simulator takes no time in the ingress
before a request enters the engine, so two requests racing for one step could land in
different steps of the real run and of the replay.

    PYTHONPATH=$PWD python tests/data/record_step_log.py [OUT]
"""

from __future__ import annotations

import asyncio
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

OUT = Path(__file__).with_name("step_log_small.jsonl")
MODEL = "SmolLM2-135M-Instruct"

# (seconds after the first request, prompt tokens, max_tokens, class)
SCHEDULE = [
    (0.0, 40, 8, "standard"),
    (1.5, 120, 16, "batch"),
    (3.0, 30, 12, "standard"),
    (3.015, 80, 6, "standard"),
    (3.05, 200, 10, "batch"),
    (5.0, 60, 24, "standard"),
    (6.5, 25, 4, "batch"),
    (6.6, 150, 20, "standard"),
    (6.7, 45, 8, "standard"),
    (6.8, 100, 12, "batch"),
    (9.0, 20, 16, "standard"),
    (10.5, 180, 6, "batch"),
    (10.55, 35, 18, "standard"),
    (12.5, 90, 10, "standard"),
    (14.0, 70, 22, "batch"),
    (14.015, 55, 4, "standard"),
]


def spare_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def send(client: httpx.AsyncClient, t0: float, k: int, line: tuple) -> str:
    at, prompt_tokens, max_tokens, cls = line
    rng = random.Random(k)
    # Distinct first tokens: no prompt shares a cached prefix block with another.
    prompt = [1000 + 97 * k] + [rng.randrange(100, 40000) for _ in range(prompt_tokens - 1)]
    await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
    resp = await client.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
        },
        headers={"x-iterserve-class": cls},
    )
    resp.raise_for_status()
    return resp.json()["id"]


async def load(url: str) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        t0 = time.monotonic() + 0.5
        return await asyncio.gather(*(send(client, t0, k, s) for k, s in enumerate(SCHEDULE)))


def main(out: Path) -> None:
    out.unlink(missing_ok=True)
    port = spare_port()
    cmd = [str(Path(sys.executable).parent / "iterserve"), "serve", "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--step-log", str(out)], stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if "is ready" in line:
                break
        else:
            raise SystemExit(f"iterserve serve ended ({proc.wait()})")
        url = f"http://127.0.0.1:{port}"
        ids = asyncio.run(load(url))
        print(f"{len(ids)} requests recorded in {out}")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
