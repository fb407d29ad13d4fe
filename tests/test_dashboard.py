"""`iterserve dashboard push` against a local HTTP stand-in for Grafana.

No Grafana server can be installed on the machines these tests run on, so a small HTTP
server takes its place: it records each request and answers as Grafana's HTTP API does
(`POST /api/datasources`, `GET /api/datasources/name/...`, `PUT /api/datasources/uid/...`,
`POST /api/dashboards/db`), and the test checks the requests' shape. That the dashboard
renders in a real Grafana is not tested here.
"""

from __future__ import annotations

import base64
import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deploy.cli import main
from deploy.dashboard import DATASOURCE_NAME, GrafanaError, _client, load_dashboard, push


class StandIn(BaseHTTPRequestHandler):
    requests: list[tuple[str, str, str, dict | None]] = []
    datasource_exists = False
    # When set: every request is answered with this status and ``{"message": ...}``.
    refuse: tuple[int, str] | None = None

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
        if self.refuse:
            return self._answer(self.refuse[0], {"message": self.refuse[1]})
        if self.path == "/api/datasources":
            if self.datasource_exists:
                return self._answer(409, {"message": "data source with the same name exists"})
            return self._answer(200, {"id": 1, "message": "Datasource added"})
        if self.path in ("/api/dashboards/db", "/grafana/api/dashboards/db"):
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
    StandIn.requests, StandIn.datasource_exists, StandIn.refuse = [], False, None
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


@pytest.mark.parametrize(
    ("status", "said"),
    [
        (401, "Unauthorized"),
        (403, "Client Error 403: Permissions needed"),
        (400, "Bad Input: `{'message': 'Permissions needed'}`"),
        (500, "Server Error 500: Permissions needed"),
    ],
)
def test_a_refusal_is_one_clear_line(grafana, monkeypatch, capsys, status, said):
    StandIn.refuse = (status, "Permissions needed")
    monkeypatch.setenv("GRAFANA_TOKEN", "t")
    argv = ["dashboard", "push", "--grafana-url", grafana, "--api-key-env", "GRAFANA_TOKEN"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err == f"iterserve: Grafana at {grafana} refused: {said}\n"
    with pytest.raises(GrafanaError) as e:
        push(grafana, "t")
    assert e.value.status_code == status and e.value.response == {"message": "Permissions needed"}


def test_an_unreachable_grafana_is_reported_not_raised(monkeypatch, capsys):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)  # a port nothing listens on, once
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    srv.server_close()
    monkeypatch.setenv("GRAFANA_TOKEN", "t")
    assert main(["dashboard", "push", "--grafana-url", url, "--api-key-env", "GRAFANA_TOKEN"]) == 1
    assert capsys.readouterr().err.startswith(f"iterserve: Grafana at {url} refused: ")


def test_basic_auth_and_a_path_prefix(grafana):
    """A ``(user, password)`` pair is sent as basic auth, and a Grafana served under a path
    (``root_url`` with a sub-path) is reached under it."""
    out = push(f"{grafana}/grafana/", ("admin", "pw"))
    assert out == {"dashboard": out["dashboard"], "datasource": None}
    assert out["dashboard"]["uid"] == "iterserve"
    ((method, path, auth, _),) = StandIn.requests
    assert (method, path) == ("POST", "/grafana/api/dashboards/db")
    assert auth == "Basic " + base64.b64encode(b"admin:pw").decode()


def test_the_url_gives_the_api_root_and_tls_verification():
    """User info in the URL is dropped (the credential authenticates); ``?verify=false``
    turns TLS verification off, and it stays on otherwise."""
    with _client("https://u:p@grafana.example:3000/grafana/?verify=false", "t") as c:
        assert str(c.base_url) == "https://grafana.example:3000/grafana/api/"
        assert c.headers["Authorization"] == "Bearer t"
        assert c._transport._pool._ssl_context.verify_mode == ssl.CERT_NONE
    with _client("https://grafana.example", "t") as c:
        assert str(c.base_url) == "https://grafana.example/api/"
        assert c._transport._pool._ssl_context.verify_mode == ssl.CERT_REQUIRED


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
