"""No app redirects between routes: a path with an empty or odd component is a 4xx of its own.

FastAPI's default ``redirect_slashes`` once answered ``DELETE /v1/control/leases/policy/`` (an empty
holder) with a 307 to the operator's lease-break route. Every app (agent, router, front, engine in
both dialects) is tried here with hostile variants of each of its own routes: a trailing slash,
each path parameter empty, a doubled slash, an encoded slash, ``..`` and ``.``. Each must be
answered 4xx, with no ``Location``, by the app itself (in process, no redirect followed).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

TOKEN = "ctl-t0ken"
H = {"Authorization": f"Bearer {TOKEN}"}
_PARAM = re.compile(r"\{([^}:]+)(?::[^}]*)?\}")


def _fill(path: str, value: str | None = None, only: str | None = None) -> str:
    """``path`` with each parameter set to a plausible value, or ``only`` set to ``value``."""

    def one(m: re.Match) -> str:
        if only is not None and m.group(1) == only:
            return value or ""
        return "1" if "version" in m.group(1) else "policy"

    return _PARAM.sub(one, path)


def hostile_variants(path: str) -> Iterator[str]:
    filled = _fill(path)
    yield filled + "/"
    yield filled + "//"
    if filled.count("/") > 1:
        head, _, tail = filled.rpartition("/")
        yield f"{head}//{tail}"
        yield f"{head}/%2F{tail}"
        yield f"{head}/%2E%2E/{tail}"
        yield f"{head}/%2E/{tail}"  # encoded: a client normalises a literal "." away
    for name in _PARAM.findall(path):
        for odd in ("", "%2F", "%2E%2E", "%2E"):
            yield _fill(path, odd, only=name)


def app_routes(routes, prefix: str = "") -> Iterator[tuple[str, set[str]]]:
    """``(path, methods)`` of every route, also inside included routers (which FastAPI 0.165
    keeps as ``_IncludedRouter`` entries instead of copying their routes)."""
    for route in routes:
        if hasattr(route, "original_router"):
            inner = prefix + getattr(route.include_context, "prefix", "")
            yield from app_routes(route.original_router.routes, inner)
        elif getattr(route, "methods", None) and getattr(route, "path", "").startswith("/"):
            yield prefix + route.path, set(route.methods)


def assert_no_redirects(client: TestClient, app) -> None:
    seen, bad = 0, []
    for route_path, methods in app_routes(app.routes):
        for method in sorted(methods - {"HEAD", "OPTIONS"}):
            for path in dict.fromkeys(hostile_variants(route_path)):
                r = client.request(method, path, headers=H, json={}, follow_redirects=False)
                seen += 1
                if not 400 <= r.status_code < 500 or "location" in r.headers:
                    bad.append(f"{method} {path} -> {r.status_code} {r.headers.get('location')}")
    assert seen >= 10, seen
    assert bad == [], "\n".join(bad)


@pytest.fixture
def agent_app(tmp_path):
    from lorafleet.agent.app import AgentConfig, create_app

    app = create_app(
        AgentConfig(
            engine="reference",
            engine_url="http://127.0.0.1:9",
            data_dir=str(tmp_path / "d"),
            token=TOKEN,
            replica_id="r0",
        )
    )
    yield app
    app.state.runtime.db.close()


def test_agent(agent_app):
    assert_no_redirects(TestClient(agent_app, raise_server_exceptions=False), agent_app)


def test_router():
    from lorafleet.router.app import RouterConfig, create_app

    app = create_app(RouterConfig(agents=["http://127.0.0.1:9"], control_token=TOKEN))
    app.balancer.replicas[0].replica_id = "r0"
    client = TestClient(app, raise_server_exceptions=False)
    assert_no_redirects(client, app.api)


def test_router_empty_holder_never_breaks_the_lease():
    from lorafleet.router.app import RouterConfig, create_app

    app = create_app(RouterConfig(agents=["http://127.0.0.1:9"], control_token=TOKEN))
    client = TestClient(app, raise_server_exceptions=False)
    r = client.post("/v1/control/leases/policy", json={"holder": "pub-1", "ttl_s": 60}, headers=H)
    assert r.status_code == 200, r.text
    r = client.delete("/v1/control/leases/policy/", headers=H)
    assert r.status_code == 404, r.text
    assert "location" not in r.headers
    # Still held by pub-1: another holder is refused.
    r = client.post("/v1/control/leases/policy", json={"holder": "pub-2", "ttl_s": 60}, headers=H)
    assert r.status_code == 409, r.text


def test_front(tmp_path):
    from lorafleet.front.app import create_app
    from lorafleet.front.service import FrontConfig

    app = create_app(
        FrontConfig(
            agents=["http://127.0.0.1:9"],
            router="http://127.0.0.1:9",
            shared_dirs=[tmp_path],
            fleet_token=TOKEN,
        )
    )
    assert_no_redirects(TestClient(app, raise_server_exceptions=False), app)


@pytest.fixture(scope="module")
def runtime(tiny_model):
    from lorafleet.engine._runtime import Runtime

    rt = Runtime(tiny_model, served_model_name="tiny", max_model_len=64)
    yield rt
    rt.close()


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_engine(runtime, dialect):
    from lorafleet.engine.app import create_app

    app = create_app(runtime, dialect=dialect)
    assert_no_redirects(TestClient(app, raise_server_exceptions=False), app)
