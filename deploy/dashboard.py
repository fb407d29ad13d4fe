"""``iterserve dashboard push``: provision the Grafana dashboard (and its data source).

Through Grafana's HTTP API with ``httpx``: the dashboard ``deploy/grafana/iterserve.json`` is
created or replaced (``POST /api/dashboards/db``; its uid is ``iterserve``), and, when a
Prometheus URL is given, a Prometheus data source of that name is created
(``POST /api/datasources``), or updated when one of that name exists
(``GET /api/datasources/name/<name>``, then ``PUT /api/datasources/uid/<uid>``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx

DASHBOARD = Path(__file__).resolve().parent / "grafana" / "iterserve.json"
DATASOURCE_NAME = "iterserve-prometheus"
# Seconds for each request (connect, read, write, pool): a Grafana that does not answer in
# that time is reported, not waited on.
TIMEOUT_S = 5.0
# What ``?verify=`` in the Grafana URL may say to turn TLS verification off.
_FALSE = {"0", "false", "f", "no", "n", "off"}


class GrafanaError(Exception):
    """Grafana refused a request, or gave no usable answer.

    Attributes:
        status_code: the HTTP status of Grafana's answer; 0 when none came (unreachable,
            timed out).
        response: Grafana's answer body: its JSON (usually ``{"message": ...}``) when it
            parses, else its text; ``None`` when no answer came.
        message: the text of the exception (``str(error)``).
    """

    def __init__(self, status_code: int, response: Any, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.response = response
        self.message = message


def load_dashboard() -> dict[str, Any]:
    """The shipped dashboard's JSON model."""
    return json.loads(DASHBOARD.read_text())


def _client(grafana_url: str, credential: str | tuple[str, str]) -> httpx.Client:
    """A client whose relative paths resolve under ``<grafana_url>/api/``.

    ``credential``: a token (API key or service-account token, sent as ``Bearer``) or a
    ``(user, password)`` pair (basic auth). ``?verify=false`` in the URL turns TLS
    verification off (a Grafana with a self-signed certificate). User info in the URL is
    dropped: the credential alone authenticates.
    """
    parts = urlsplit(grafana_url)
    verify = parse_qs(parts.query).get("verify", ["true"])[0].strip().lower() not in _FALSE
    host = parts.netloc.rpartition("@")[2]
    base = f"{parts.scheme}://{host}{parts.path.rstrip('/')}/api"
    if isinstance(credential, tuple):
        return httpx.Client(
            base_url=base,
            auth=httpx.BasicAuth(*credential),
            verify=verify,
            timeout=TIMEOUT_S,
            follow_redirects=True,
        )
    return httpx.Client(
        base_url=base,
        # A header of the client, not of the URL: httpx drops it on a redirect to another host.
        headers={"Authorization": f"Bearer {credential}"},
        verify=verify,
        timeout=TIMEOUT_S,
        follow_redirects=True,
    )


def _call(client: httpx.Client, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """Grafana's answer to one request: its JSON, its text (a ``text/*`` answer), or ``None``
    (204).

    Raises:
        GrafanaError: no answer (``status_code`` 0), an answer of 400 or more (the message
            says which: ``Bad Input``, ``Unauthorized``, ``Client Error <status>``,
            ``Server Error <status>``, with Grafana's own message), or a 2xx answer that is
            not JSON.
    """
    try:
        r = client.request(method, path, json=body)
    except httpx.HTTPError as e:
        raise GrafanaError(0, None, str(e) or type(e).__name__) from e
    if r.status_code >= 400:
        try:
            answer: Any = r.json()
        except ValueError:
            answer = r.text
        said = answer["message"] if isinstance(answer, dict) and "message" in answer else r.text
        if r.status_code >= 500:
            raise GrafanaError(r.status_code, answer, f"Server Error {r.status_code}: {said}")
        if r.status_code == 400:
            raise GrafanaError(400, answer, f"Bad Input: `{answer}`")
        if r.status_code == 401:
            raise GrafanaError(401, answer, "Unauthorized")
        raise GrafanaError(r.status_code, answer, f"Client Error {r.status_code}: {said}")
    if r.status_code == 204:
        return None
    if r.headers.get("Content-Type", "").startswith("text/"):
        return r.text
    try:
        return r.json()
    except ValueError as e:
        raise GrafanaError(
            r.status_code, r.text, f"answer to {method} {path} is not JSON: {r.text[:200]!r}"
        ) from e


def push(
    grafana_url: str,
    api_key: str | tuple[str, str],
    *,
    prometheus_url: str | None = None,
    folder_uid: str | None = None,
) -> dict[str, Any]:
    """Create or replace the dashboard; with ``prometheus_url``, its data source too.

    ``api_key``: an API key or service-account token (sent as ``Bearer``), or a
    ``(user, password)`` pair for basic auth.

    Returns:
        ``{"dashboard": Grafana's answer, "datasource": its answer or None}``; the dashboard's
        answer is ``{"status", "uid", "url", "version", ...}``.

    Raises:
        GrafanaError: Grafana refused a request (bad key, no permission) or was unreachable.
    """
    with _client(grafana_url, api_key) as client:
        datasource = None
        if prometheus_url:
            body = {
                "name": DATASOURCE_NAME,
                "type": "prometheus",
                "url": prometheus_url,
                "access": "proxy",
                "isDefault": False,
            }
            try:
                datasource = _call(client, "POST", "/datasources", body)
            except GrafanaError as e:
                if e.status_code != 409:  # 409: a data source of that name exists: update it
                    raise
                existing = _call(client, "GET", f"/datasources/name/{DATASOURCE_NAME}")
                datasource = _call(client, "PUT", f"/datasources/uid/{existing['uid']}", body)
        payload: dict[str, Any] = {
            "dashboard": {**load_dashboard(), "id": None},
            "overwrite": True,
            "message": "iterserve dashboard push",
        }
        if folder_uid:
            payload["folderUid"] = folder_uid
        return {
            "dashboard": _call(client, "POST", "/dashboards/db", payload),
            "datasource": datasource,
        }


def main(args: Any) -> int:
    """The CLI's ``dashboard push`` (``args``: grafana_url, api_key_env, prometheus_url,
    folder_uid).

    Raises:
        ValueError: the environment variable named by ``--api-key-env`` is unset or empty.
        GrafanaError: as :func:`push`.
    """
    key = os.environ.get(args.api_key_env)
    if not key:
        raise ValueError(
            f"environment variable {args.api_key_env} (--api-key-env) holds no "
            "Grafana API key or service-account token"
        )
    out = push(
        args.grafana_url, key, prometheus_url=args.prometheus_url, folder_uid=args.folder_uid
    )
    print(f"dashboard pushed: {args.grafana_url.rstrip('/')}{out['dashboard'].get('url', '')}")
    if out["datasource"] is not None:
        print(f"data source {DATASOURCE_NAME!r} -> {args.prometheus_url}")
    return 0
