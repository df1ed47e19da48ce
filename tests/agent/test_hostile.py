"""Hostile names, versions and paths get a precise 4xx from the agent, never a 500.

In process (the agent's app with no engine behind it): every refusal here happens before the
engine or the store would be touched.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from lorafleet.agent.app import AgentConfig, create_app

TOKEN = "t0ken"
H = {"Authorization": f"Bearer {TOKEN}"}
CFG = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "peft_type": "LORA"}
FILES = [{"path": "adapter_config.json", "size": 2, "sha256": "0" * 64}]


@pytest.fixture
def agent(tmp_path):
    shared = tmp_path / "shared"
    (shared / "a").mkdir(parents=True)
    (shared / "file").write_text("{}")
    cfg = AgentConfig(
        engine="reference",
        engine_url="http://127.0.0.1:9",
        data_dir=str(tmp_path / "d"),
        token=TOKEN,
        replica_id="r0",
        shared_fs_allow=[str(shared)],
    )
    app = create_app(cfg)
    client = TestClient(app, raise_server_exceptions=False)
    client.shared = shared  # type: ignore[attr-defined]
    yield client
    app.state.runtime.db.close()


def _expect(r, status: int, code: str, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and r.headers["x-lorafleet-error-code"] == code
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize("route", ["load", "verify", "activate", "unload"])
@pytest.mark.parametrize("version", [2**63, 2**64 + 5, 10**40])
def test_versions_sqlite_cannot_hold_are_400(agent, route, version):
    r = agent.post(f"/v1/adapters/{route}", json={"name": "p", "version": version}, headers=H)
    _expect(r, 400, "invalid_request", "version")


def test_the_largest_version_is_looked_up(agent):
    r = agent.post("/v1/adapters/activate", json={"name": "p", "version": 2**63 - 1}, headers=H)
    _expect(r, 404, "adapter_not_found")


def test_a_manifest_version_over_the_cap_is_refused_at_open(agent):
    # It used to open, upload and then overflow SQLite at commit (500).
    manifest = {"name": "p", "version": 2**63, "config": CFG, "files": FILES}
    r = agent.post("/v1/uploads", json={"manifest": manifest}, headers=H)
    _expect(r, 400, "invalid_request", "manifest.version")


@pytest.mark.parametrize("name", ["policy\n", "..", "a\x00b", "a" * 4096, "x\u202ey", ""])
def test_hostile_names_on_every_body(agent, name):
    manifest = {"name": name, "version": 1, "config": CFG, "files": FILES}
    _expect(agent.post("/v1/uploads", json={"manifest": manifest}, headers=H), 400, "invalid_name")
    for route in ("load", "verify", "activate", "unload"):
        r = agent.post(f"/v1/adapters/{route}", json={"name": name, "version": 1}, headers=H)
        _expect(r, 400, "invalid_name", "name")


@pytest.mark.parametrize(
    "path",
    [
        "{shared}/a\x00b",  # os.stat raises ValueError
        "{shared}/" + "x" * 300,  # ENAMETOOLONG
        "{shared}/" + "x/" * 2100,  # over PATH_MAX
        "{shared}/\ud800",  # not valid UTF-8
        "",
    ],
)
def test_register_refuses_unaskable_paths_before_the_filesystem(agent, path):
    manifest = {"name": "p", "version": 1, "config": CFG, "files": FILES}
    body = json.dumps({"manifest": manifest, "path": path.format(shared=agent.shared)})
    r = agent.post(
        "/v1/adapters/register",
        content=body.encode(),
        headers={**H, "Content-Type": "application/json"},
    )
    _expect(r, 400, "invalid_request", "path")


def test_register_a_file_or_a_missing_component_is_400(agent):
    manifest = {"name": "p", "version": 1, "config": CFG, "files": FILES}
    for path in (agent.shared / "file", agent.shared / ("y" * 255) / "z"):
        r = agent.post(
            "/v1/adapters/register", json={"manifest": manifest, "path": str(path)}, headers=H
        )
        _expect(r, 400, "invalid_request")


def test_a_405_names_the_allowed_methods(agent):
    r = agent.request("TRACE", "/v1/adapters")
    assert r.status_code == 405 and r.headers["allow"] == "GET"


def test_openapi_documents_statuses_content_types_and_the_bearer_scheme(agent):
    from prometheus_client import CONTENT_TYPE_LATEST

    spec = agent.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["controlToken"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "Authorization: Bearer <control token>",
    }
    assert "HTTPValidationError" not in json.dumps(spec)
    put = spec["paths"]["/v1/uploads/{upload_id}/files/{path}"]["put"]
    assert "content-length" not in {p["name"].lower() for p in put["parameters"]}
    assert set(put["responses"]) >= {"200", "400", "401", "403", "404", "409", "413", "422", "507"}
    assert put["security"] == [{"controlToken": []}]
    load = spec["paths"]["/v1/adapters/load"]["post"]["responses"]
    assert set(load) >= {"200", "400", "401", "403", "404", "409", "413", "502", "503", "507"}
    metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == [CONTENT_TYPE_LATEST]
    assert agent.get("/metrics").headers["content-type"] == CONTENT_TYPE_LATEST
    assert "security" not in spec["paths"]["/health"]["get"]
