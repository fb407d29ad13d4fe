"""`iterserve dashboard push` against a local HTTP stand-in for Grafana.

No Grafana server can be installed on the machines these tests run on, so a small HTTP
server takes its place: it records each request and answers as Grafana's HTTP API does
(`POST /api/datasources`, `GET /api/datasources/name/...`, `PUT /api/datasources/uid/...`,
`POST /api/dashboards/db`), and the test checks the requests' shape. That the dashboard
renders in a real Grafana is not tested here.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deploy.cli import main
from deploy.dashboard import DATASOURCE_NAME, load_dashboard


class StandIn(BaseHTTPRequestHandler):
    requests: list[tuple[str, str, str, dict | None]] = []
    datasource_exists = False

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> dict | None:
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n)) if n else None
        self.requests.append((self.command, self.path, self.headers.get("Authorization"), body))
        return body

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        self._record()
        if self.path == "/api/datasources":
            if self.datasource_exists:
                return self._answer(409, {"message": "data source with the same name exists"})
            return self._answer(200, {"id": 1, "message": "Datasource added"})
        if self.path == "/api/dashboards/db":
            return self._answer(
                200,
                {
                    "status": "success",
                    "uid": "iterserve",
                    "url": "/d/iterserve/iterserve",
                    "version": 1,
                },
            )
        self._answer(404, {"message": "not found"})

    def do_GET(self) -> None:  # noqa: N802
        self._record()
        if self.path == f"/api/datasources/name/{DATASOURCE_NAME}":
            return self._answer(200, {"id": 1, "uid": "ds-1", "name": DATASOURCE_NAME})
        self._answer(404, {"message": "not found"})

    def do_PUT(self) -> None:  # noqa: N802
        self._record()
        if self.path == "/api/datasources/uid/ds-1":
            return self._answer(200, {"message": "Datasource updated"})
        self._answer(404, {"message": "not found"})

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def grafana():
    StandIn.requests, StandIn.datasource_exists = [], False
    srv = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_push_creates_the_datasource_and_the_dashboard(grafana, monkeypatch, capsys):
    monkeypatch.setenv("GRAFANA_TOKEN", "glsa_secret")
    assert (
        main(
            [
                "dashboard",
                "push",
                "--grafana-url",
                grafana,
                "--api-key-env",
                "GRAFANA_TOKEN",
                "--prometheus-url",
                "http://prom:9090",
            ]
        )
        == 0
    )
    (m1, p1, auth1, ds), (m2, p2, auth2, dash) = StandIn.requests
    assert (m1, p1, m2, p2) == ("POST", "/api/datasources", "POST", "/api/dashboards/db")
    assert auth1 == auth2 == "Bearer glsa_secret"
    assert ds["type"] == "prometheus" and ds["url"] == "http://prom:9090"
    assert ds["name"] == DATASOURCE_NAME and ds["access"] == "proxy"
    assert dash["overwrite"] is True and dash["dashboard"]["uid"] == "iterserve"
    assert dash["dashboard"]["id"] is None  # Grafana matches on uid, not on a local id
    assert dash["dashboard"]["panels"] == load_dashboard()["panels"]
    assert "/d/iterserve/iterserve" in capsys.readouterr().out


def test_push_updates_an_existing_datasource_and_needs_the_key(grafana, monkeypatch, capsys):
    StandIn.datasource_exists = True
    monkeypatch.setenv("GRAFANA_TOKEN", "t")
    assert (
        main(
            [
                "dashboard",
                "push",
                "--grafana-url",
                grafana,
                "--api-key-env",
                "GRAFANA_TOKEN",
                "--prometheus-url",
                "http://prom:9090",
                "--folder-uid",
                "ops",
            ]
        )
        == 0
    )
    calls = [(m, p) for m, p, _, _ in StandIn.requests]
    assert calls == [
        ("POST", "/api/datasources"),
        ("GET", f"/api/datasources/name/{DATASOURCE_NAME}"),
        ("PUT", "/api/datasources/uid/ds-1"),
        ("POST", "/api/dashboards/db"),
    ]
    assert StandIn.requests[-1][3]["folderUid"] == "ops"
    # Without the key in the environment: a clear error, and nothing sent.
    StandIn.requests.clear()
    monkeypatch.delenv("GRAFANA_TOKEN")
    assert (
        main(["dashboard", "push", "--grafana-url", grafana, "--api-key-env", "GRAFANA_TOKEN"]) == 2
    )
    assert "GRAFANA_TOKEN" in capsys.readouterr().err and not StandIn.requests


def test_replicas_panel_shows_running_and_target_replicas():
    """Both gauges of the ingress over time, in a panel of their own; that every query returns
    data from a real server is tests/test_observability.py's check."""
    panels = load_dashboard()["panels"]
    (panel,) = [p for p in panels if "iterserve:num_replicas_target" in json.dumps(p)]
    exprs = [t["expr"] for t in panel["targets"]]
    assert exprs == [
        'max by (model) (iterserve:num_replicas{model=~"$model"})',
        'max by (model) (iterserve:num_replicas_target{model=~"$model"})',
    ]
    assert len({t["refId"] for t in panel["targets"]}) == 2
    # The grid stays a grid: unique ids, no two panels on the same cells.
    assert len({p["id"] for p in panels}) == len(panels)
    cells = [
        (x, y)
        for p in panels
        for x in range(p["gridPos"]["x"], p["gridPos"]["x"] + p["gridPos"]["w"])
        for y in range(p["gridPos"]["y"], p["gridPos"]["y"] + p["gridPos"]["h"])
    ]
    assert len(cells) == len(set(cells))
