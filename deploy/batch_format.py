"""OpenAI's batch file format (as vLLM's ``run-batch`` reads and writes it), and the
output file that makes a batch resumable with every record written exactly once.

Input: one JSON object a line, ``{"custom_id", "method": "POST", "url", "body"}``, where
``url`` is ``/v1/completions``, ``/v1/chat/completions`` or ``/v1/embeddings`` and ``body``
the API's request body. Output: one JSON object a line, ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}``; ``error`` is null for a 200, else
``{"code", "message"}``, and ``response.body`` then holds the API's error body.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router.errors import ApiError

BATCH_CLASS = "batch"
"""The traffic class batch lines run at."""

URLS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
"""The endpoints a batch line may name (:data:`router.ingress.ANSWERED`)."""


class BatchFileError(ValueError):
    """The input or output file cannot be used at all; the message names the lines."""


@dataclass(slots=True)
class BatchLine:
    """One input line: a request to run, or (``error`` set) one answered with an error."""

    line_no: int
    """1-based line number in the input file."""
    custom_id: str
    url: str = ""
    """One of :data:`URLS` (unless ``error`` is set)."""
    body: dict[str, Any] | None = None
    error: ApiError | None = None


def _parse_line(n: int, text: str) -> tuple[BatchLine | None, str | None]:
    """The line, or None and why its ``custom_id`` cannot be read."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        return BatchLine(
            n,
            f"line-{n}",
            error=ApiError(400, f"line {n} is not valid JSON: {e}", code="invalid_json"),
        ), None
    if not isinstance(obj, dict):
        return BatchLine(
            n,
            f"line-{n}",
            error=ApiError(400, f"line {n} is not a JSON object", code="invalid_json"),
        ), None
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return None, "has no custom_id (a non-empty string)"
    line = BatchLine(n, cid, url=obj.get("url"), body=obj.get("body"))
    if obj.get("method", "POST") != "POST":
        line.error = ApiError(
            400,
            f"method {obj.get('method')!r}: only POST is supported",
            param="method",
            code="invalid_value",
        )
    elif line.url not in URLS:
        line.error = ApiError(
            404,
            f"url {line.url!r} is not a batch endpoint; use one of {list(URLS)}",
            param="url",
            code="unknown_url",
        )
    elif not isinstance(line.body, dict):
        line.error = ApiError(
            400,
            "body must be a JSON object (the API's request body)",
            param="body",
            code="invalid_value",
        )
    elif line.body.get("stream"):
        line.error = ApiError(
            400, "stream: a batch request cannot be streamed", param="stream", code="invalid_value"
        )
    return line, None


def read_input(path: str | Path) -> list[BatchLine]:
    """Every non-blank line of the batch file at ``path``.

    Bad lines come back with ``error`` set: not JSON (its ``custom_id`` is ``line-N``), not
    POST, an unknown ``url``, a body that is not an object or asks to stream.

    Raises:
        BatchFileError: some lines lack a ``custom_id`` or repeat one (the output could
            not be matched to the input); the message names the lines.
        OSError: the file cannot be read.
    """
    lines: list[BatchLine] = []
    missing: list[str] = []
    first_seen: dict[str, int] = {}
    repeated: list[str] = []
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, start=1):
            if not text.strip():
                continue
            line, why = _parse_line(n, text)
            if line is None:
                missing.append(f"line {n} {why}")
                continue
            if line.custom_id in first_seen:
                repeated.append(
                    f"line {n} repeats custom_id {line.custom_id!r} of line "
                    f"{first_seen[line.custom_id]}"
                )
            first_seen.setdefault(line.custom_id, n)
            lines.append(line)
    if missing or repeated:
        shown = (missing + repeated)[:20]
        more = len(missing) + len(repeated) - len(shown)
        raise BatchFileError(
            f"{path}: nothing was run: " + "; ".join(shown) + (f"; and {more} more" if more else "")
        )
    return lines


def record(custom_id: str, status: int, request_id: str, body: dict[str, Any]) -> dict:
    """One output line: the API's ``status`` and ``body`` for the request ``custom_id``.

    A non-200 ``body`` is the API's error body (``{"error": {"message", "code", ...}}``),
    also summarised in ``error``.
    """
    error = None
    if status != 200:
        err = body.get("error") or {}
        error = {"code": err.get("code") or str(status), "message": err.get("message", "")}
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": error,
    }


def error_record(custom_id: str, error: ApiError) -> dict:
    """The output line of a request answered with ``error``."""
    return record(custom_id, error.status, f"batch-{uuid.uuid4().hex}", error.body())


class OutputFile:
    """The output file, appended one whole line at a time and resumable.

    Opening it repairs a torn last line (a kill mid-write) and reads which ``custom_id``s
    are done, so a rerun writes only the others: after any number of kills and reruns the
    file holds each input line's record exactly once.

    Raises (at construction):
        BatchFileError: a line other than the last is not a record, or a record is not
            of this input (``known_ids``).
    """

    def __init__(self, path: str | Path, known_ids: set[str]) -> None:
        self.path = Path(path)
        self.done: set[str] = set()
        self.repaired_bytes = 0
        if self.path.exists():
            data = self.path.read_bytes()
            whole = data.rfind(b"\n") + 1
            # Every whole line is checked before the torn tail is cut: a file that is not
            # this input's output stays as it was.
            self._read(data[:whole].decode("utf-8", errors="replace"), known_ids)
            if whole < len(data):  # torn: the last write did not finish
                self.repaired_bytes = len(data) - whole
                os.truncate(self.path, whole)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _read(self, text: str, known_ids: set[str]) -> None:
        for n, line in enumerate(text.splitlines(), start=1):
            try:
                rec = json.loads(line)
                cid = rec["custom_id"]
                rec["response"]  # an input line has a custom_id too, but no response
            except (ValueError, KeyError, TypeError):
                raise BatchFileError(
                    f"{self.path}: line {n} is not a batch output "
                    "record; is this the right output file?"
                ) from None
            if cid not in known_ids:
                raise BatchFileError(
                    f"{self.path}: line {n} answers custom_id {cid!r}, "
                    "which the input does not have; is this the output "
                    "of another input?"
                )
            self.done.add(cid)

    def write(self, rec: dict) -> None:
        """Append one record as one line (one write call), so a kill tears at most it."""
        os.write(self._fd, (json.dumps(rec, ensure_ascii=False) + "\n").encode())
        self.done.add(rec["custom_id"])

    def close(self) -> None:
        os.close(self._fd)

    def write_ordered(self, lines: list[BatchLine]) -> Path:
        """A copy of the output in input order, beside it (``OUT.ordered.jsonl``)."""
        by_id: dict[str, str] = {}
        with open(self.path, encoding="utf-8") as f:
            for text in f:
                by_id[json.loads(text)["custom_id"]] = text
        dest = self.path.with_name(self.path.stem + ".ordered" + (self.path.suffix or ".jsonl"))
        tmp = dest.with_name(dest.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(by_id[line.custom_id] for line in lines if line.custom_id in by_id)
        os.replace(tmp, dest)
        return dest
