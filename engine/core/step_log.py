"""The step log: every engine step and every request's arrival, admission, refusal and
finish, as JSON lines, kept in memory for ``GET /steps`` and, optionally, in a file.

Writing: :class:`StepRecorder` (one per replica) is fed by the engine (a step listener,
:meth:`engine.LLMEngine.add_step_listener`, and ``on_finish``, on the engine's thread) and
by the ingress (:meth:`StepRecorder.arrival`, ``admitted``, ``refused``, on the event
loop).
Reading: :class:`StepLog` parses the records back (``iterserve simulate --replay-steps``,
``iterserve calibrate --from-url``).

One JSON object per line, each with ``"type"``; times are seconds on the engine's clock
(``time.monotonic`` on the server, the same clock the ingress stamps arrivals on):

* ``header`` (first line of a file, and the head of ``GET /steps``): ``version``
  (:data:`VERSION`), ``engine`` (``num_kv_blocks``, ``block_size``, ``max_model_len``,
  ``vocab_size``, ``model``, and ``config``: the :class:`engine.EngineConfig` fields).
* ``step``: ``i`` (index), ``t`` (start), ``dur`` (seconds, schedule to outputs),
  ``sched`` (seconds in the scheduler), ``tok`` (seconds from ``t`` until its tokens
  were stamped), ``pred`` (the admission model's prediction), ``decodes``, ``prefill``
  (tokens), ``waiting`` and ``running`` (after the step), ``seqs`` (``[request id,
  first position scheduled, tokens]`` each, decodes first), ``preempted`` (ids), and the
  TPOT guard's plan: ``cap`` and ``owed`` (prefill token caps; null: none), ``sat_out``
  and ``shed`` (ids).
* ``arrival``: ``t`` (when the ingress received it), ``id``, ``class``, ``priority``,
  ``prompt_tokens``, ``max_tokens``.
* ``admit``: ``t``, ``id``, ``held_s`` (seconds admission held it).
* ``refuse``: ``t``, ``id``, ``reason``.
* ``finish``: ``t`` (finish time), ``id``, ``class``, ``priority``, ``prompt_tokens``,
  ``max_tokens``, ``output_tokens``, ``engine_arrival``, ``first_token`` (null: none),
  ``reason`` (``stop``, ``length``, ``abort``).

A request the ingress never saw (the engine used directly) has only its ``finish``;
its arrival is then its ``engine_arrival``.
"""

from __future__ import annotations

import gzip
import json
import math
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from engine.core.interfaces import FinishRecord, StepRecord

VERSION = 1
"""The format's version, in every header."""
HISTORY = 20_000
"""Records a recorder keeps in memory by default (steps and events together)."""
IDLE_GAP_S = 0.02
"""A gap between steps longer than this is idleness, not work: the serving loop polls
every ``engine.async_engine.IDLE_TICK_S`` when it has nothing to do."""
STEP_KINDS = ("decode", "mixed", "prefill")


def step_kind(num_prefill_tokens: int, num_decodes: int) -> str:
    """``decode`` (decodes only), ``prefill`` (prefill chunks only) or ``mixed``."""
    if not num_prefill_tokens:
        return "decode"
    return "prefill" if not num_decodes else "mixed"


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else x


def step_json(r: StepRecord) -> dict[str, Any]:
    """One :class:`engine.core.interfaces.StepRecord` as a ``step`` record."""
    return {
        "type": "step",
        "i": r.index,
        "t": r.start,
        "dur": r.seconds,
        "sched": r.schedule_s,
        "tok": r.tokens_at,
        "pred": _finite(r.predicted_s),
        "decodes": r.num_decodes,
        "prefill": r.num_prefill_tokens,
        "waiting": r.num_waiting,
        "running": r.num_running,
        "seqs": [list(s) for s in r.seqs],
        "preempted": list(r.preempted),
        "cap": _finite(r.prefill_cap),
        "owed": _finite(r.owed_cap),
        "sat_out": list(r.sat_out),
        "shed": list(r.shed),
    }


def finish_json(f: FinishRecord) -> dict[str, Any]:
    """One :class:`engine.core.interfaces.FinishRecord` as a ``finish`` record."""
    return {
        "type": "finish",
        "t": f.finish,
        "id": f.request_id,
        "class": f.traffic_class,
        "priority": f.priority,
        "prompt_tokens": f.prompt_tokens,
        "max_tokens": f.max_tokens,
        "output_tokens": f.output_tokens,
        "engine_arrival": f.arrival,
        "first_token": f.first_token,
        "reason": f.reason,
    }


class StepRecorder:
    """Keeps a replica's recent steps and request events; appends them to a file too.

    Thread-safe: the engine's thread records steps and finishes, the event loop records
    the ingress's events.

    Args:
        engine_info: the header's ``engine`` object (see the module's docstring).
        path: a JSONL file to append to (its header first); None: memory only.
        history: records kept in memory for :meth:`recent` (0: none).

    Raises:
        OSError: ``path`` cannot be opened for appending.
    """

    def __init__(
        self, engine_info: dict[str, Any], path: str | Path | None = None, history: int = HISTORY
    ) -> None:
        self.header = {"type": "header", "version": VERSION, "engine": engine_info}
        self._recent: deque[dict[str, Any]] = deque(maxlen=max(0, history))
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        if path is not None:
            self._file = Path(path).open("a", buffering=1)
            self._file.write(json.dumps(self.header) + "\n")

    def attach(self, engine) -> None:
        """Record ``engine``'s steps and finishes (an :class:`engine.LLMEngine`): a step
        listener after those added before."""
        engine.add_step_listener(self.step)
        engine.on_finish = self.finish

    def _add(self, rec: dict[str, Any]) -> None:
        line = json.dumps(rec) + "\n" if self._file is not None else ""
        with self._lock:
            self._recent.append(rec)
            if self._file is not None:
                self._file.write(line)

    def step(self, r: StepRecord) -> None:
        self._add(step_json(r))

    def finish(self, f: FinishRecord) -> None:
        self._add(finish_json(f))

    def arrival(
        self,
        request_id: str,
        t: float,
        traffic_class: str,
        priority: int,
        prompt_tokens: int,
        max_tokens: int | None,
    ) -> None:
        """The ingress received the request at ``t`` (its prompt now tokenized)."""
        self._add(
            {
                "type": "arrival",
                "t": t,
                "id": request_id,
                "class": traffic_class,
                "priority": priority,
                "prompt_tokens": prompt_tokens,
                "max_tokens": max_tokens,
            }
        )

    def admitted(self, request_id: str, t: float, held_s: float) -> None:
        """Admission let the request in at ``t``, after holding it ``held_s`` seconds."""
        self._add({"type": "admit", "t": t, "id": request_id, "held_s": held_s})

    def refused(self, request_id: str, t: float, reason: str) -> None:
        """Admission refused the request at ``t`` (its 429's message in ``reason``)."""
        self._add({"type": "refuse", "t": t, "id": request_id, "reason": reason})

    def recent(self, since: float | None = None) -> list[dict[str, Any]]:
        """The header, then the records kept in memory, oldest first; with ``since``,
        those at or after it (engine clock)."""
        with self._lock:
            records = list(self._recent)
        if since is not None:
            records = [r for r in records if r["t"] >= since]
        return [self.header, *records]

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def engine_info(engine) -> dict[str, Any]:
    """The header's ``engine`` object for an :class:`engine.LLMEngine`."""
    return {
        "model": engine.model_dir,
        "num_kv_blocks": engine.block_manager.num_blocks,
        "block_size": engine.config.block_size,
        "max_model_len": engine.max_model_len,
        "vocab_size": engine.vocab_size,
        "weights": None if engine.weights is None else asdict(engine.weights),
        "config": engine.config.model_dump(mode="json"),
    }


# -- reading -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoggedStep:
    """A ``step`` record. ``period`` is the seconds from its start to the next step's
    (the serving loop's time between steps counted in), or its own ``seconds`` where
    idleness (more than :data:`IDLE_GAP_S`) or the end of the log follows."""

    index: int
    start: float
    seconds: float
    tokens_at: float
    period: float
    seqs: tuple[tuple[str, int, int], ...]
    num_decodes: int
    num_prefill_tokens: int
    preempted: tuple[str, ...]
    cap: float | None
    owed: float | None
    sat_out: tuple[str, ...]
    shed: tuple[str, ...]

    @property
    def kind(self) -> str:
        """:func:`step_kind` of the step."""
        return step_kind(self.num_prefill_tokens, self.num_decodes)

    @property
    def composition(self) -> tuple[tuple[str, int, int], ...]:
        """What it computed, order aside: ``(request id, first position, tokens)``."""
        return tuple(sorted(self.seqs))


@dataclass(slots=True)
class LoggedRequest:
    """One request's events. ``arrival`` is the ingress's time (else the engine's)."""

    id: str
    arrival: float
    traffic_class: str
    priority: int | None
    prompt_tokens: int
    max_tokens: int | None
    admitted: float | None = None
    held_s: float | None = None
    """Seconds admission held it before admitting it."""
    refused: float | None = None
    reason: str = ""
    engine_arrival: float | None = None
    first_token: float | None = None
    finish: float | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot_s(self) -> float | None:
        n = self.output_tokens or 0
        if self.first_token is None or self.finish is None or n < 2:
            return None
        return (self.finish - self.first_token) / (n - 1)


@dataclass(slots=True)
class StepLog:
    """A parsed step log: its header's ``engine`` object, its steps in order and its
    requests by id (in arrival order)."""

    engine: dict[str, Any]
    steps: list[LoggedStep]
    requests: dict[str, LoggedRequest] = field(default_factory=dict)

    @classmethod
    def read(cls, path: str | Path) -> StepLog:
        """Parse a file written by a :class:`StepRecorder` (gzipped if it ends in ``.gz``).

        Raises:
            OSError: it cannot be read; ValueError: not a step log (see :meth:`parse`).
        """
        path = Path(path)
        opened = gzip.open(path, "rt") if path.suffix == ".gz" else path.open()
        with opened as f:
            try:
                return cls.parse(json.loads(line) for line in f if line.strip())
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not JSON lines ({e})") from None

    @classmethod
    def parse(cls, records: Iterable[dict[str, Any]]) -> StepLog:
        """From records (a file's lines, or ``GET /steps``'s ``records``). A file that
        was appended to by several runs keeps the last run's records only.

        Raises:
            ValueError: no header, another format version, or a malformed record.
        """
        header, body = None, []
        for rec in records:
            if not isinstance(rec, dict) or "type" not in rec:
                raise ValueError(f"not a step-log record: {str(rec)[:80]}")
            if rec["type"] == "header":
                header, body = rec, []
            else:
                body.append(rec)
        if header is None:
            raise ValueError("no header record: not a step log")
        if header.get("version") != VERSION:
            raise ValueError(f"step log version {header.get('version')}, expected {VERSION}")
        try:
            return cls._build(header["engine"], body)
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed step-log record ({type(e).__name__}: {e})") from None

    @classmethod
    def _build(cls, engine: dict[str, Any], body: list[dict[str, Any]]) -> StepLog:
        raw = sorted((r for r in body if r["type"] == "step"), key=lambda r: r["i"])
        steps = []
        for r, nxt in zip(raw, [*raw[1:], None]):
            gap = None if nxt is None else nxt["t"] - (r["t"] + r["dur"])
            period = r["dur"] + gap if gap is not None and 0 <= gap < IDLE_GAP_S else r["dur"]
            steps.append(
                LoggedStep(
                    r["i"],
                    r["t"],
                    r["dur"],
                    r["tok"],
                    period,
                    tuple((s[0], s[1], s[2]) for s in r["seqs"]),
                    r["decodes"],
                    r["prefill"],
                    tuple(r["preempted"]),
                    r["cap"],
                    r["owed"],
                    tuple(r["sat_out"]),
                    tuple(r["shed"]),
                )
            )
        requests: dict[str, LoggedRequest] = {}
        for r in sorted((r for r in body if r["type"] != "step"), key=lambda r: r["t"]):
            kind, rid = r["type"], r["id"]
            req = requests.get(rid)
            if kind == "arrival":
                requests[rid] = LoggedRequest(
                    rid, r["t"], r["class"], r["priority"], r["prompt_tokens"], r["max_tokens"]
                )
            elif kind == "finish":
                if req is None:
                    req = requests[rid] = LoggedRequest(
                        rid,
                        r["engine_arrival"],
                        r["class"],
                        r["priority"],
                        r["prompt_tokens"],
                        r["max_tokens"],
                    )
                req.engine_arrival, req.first_token, req.finish = (
                    r["engine_arrival"],
                    r["first_token"],
                    r["t"],
                )
                req.output_tokens, req.finish_reason = r["output_tokens"], r["reason"]
                req.max_tokens = req.max_tokens if req.max_tokens is not None else r["max_tokens"]
            elif req is None:
                continue  # its arrival fell out of the kept history
            elif kind == "admit":
                req.admitted, req.held_s = r["t"], r["held_s"]
            elif kind == "refuse":
                req.refused, req.reason = r["t"], r["reason"]
        ordered = dict(sorted(requests.items(), key=lambda kv: kv[1].arrival))
        return cls(engine, steps, ordered)

    def kinds(self) -> dict[str, list[LoggedStep]]:
        """The steps by :attr:`LoggedStep.kind`."""
        out: dict[str, list[LoggedStep]] = {k: [] for k in STEP_KINDS}
        for s in self.steps:
            out[s.kind].append(s)
        return out


def window(log: StepLog, start: float, end: float) -> StepLog:
    """The part of ``log`` between ``start`` and ``end`` (engine clock): steps that began
    and requests that arrived in ``[start, end)``; a run between idle gaps."""
    steps = [s for s in log.steps if start <= s.start < end]
    reqs = {k: r for k, r in log.requests.items() if start <= r.arrival < end}
    return StepLog(log.engine, steps, reqs)
