"""``iterserve dashboard push``: provision the Grafana dashboard (and its data source).

Through ``grafana-client`` (the maintained continuation of ``grafana-api``): the dashboard
``deploy/grafana/iterserve.json`` is created or replaced (its uid is ``iterserve``), and,
when a Prometheus URL is given, a Prometheus data source of that name is created (or
updated when one of that name exists).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError

DASHBOARD = Path(__file__).resolve().parent / "grafana" / "iterserve.json"
DATASOURCE_NAME = "iterserve-prometheus"


def load_dashboard() -> dict[str, Any]:
    """The shipped dashboard's JSON model."""
    return json.loads(DASHBOARD.read_text())


def push(
    grafana_url: str,
    api_key: str,
    *,
    prometheus_url: str | None = None,
    folder_uid: str | None = None,
) -> dict[str, Any]:
    """Create or replace the dashboard; with ``prometheus_url``, its data source too.

    Returns:
        ``{"dashboard": Grafana's answer, "datasource": its answer or None}``.

    Raises:
        grafana_client.client.GrafanaException: Grafana refused a request (bad key, no
            permission, unreachable).
    """
    api = GrafanaApi.from_url(grafana_url, credential=api_key)
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
            datasource = api.datasource.create_datasource(body)
        except GrafanaClientError as e:
            if e.status_code != 409:  # 409: a data source of that name exists: update it
                raise
            existing = api.datasource.get_datasource_by_name(DATASOURCE_NAME)
            datasource = api.datasource.update_datasource_by_uid(existing["uid"], body)
    payload: dict[str, Any] = {
        "dashboard": {**load_dashboard(), "id": None},
        "overwrite": True,
        "message": "iterserve dashboard push",
    }
    if folder_uid:
        payload["folderUid"] = folder_uid
    return {"dashboard": api.dashboard.update_dashboard(payload), "datasource": datasource}


def main(args: Any) -> int:
    """The CLI's ``dashboard push`` (``args``: grafana_url, api_key_env, prometheus_url,
    folder_uid)."""
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
