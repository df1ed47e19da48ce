"""Hypothesis over tokens, names and routes on a fleet with tenants: a tenant's token gets
nothing but a not-found (or a 400 for a name no adapter could have) for a name it does not own,
and no request with a tenant's, a wrong or no token changes the router's table or the agents'
stores."""

from __future__ import annotations

from urllib.parse import quote

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorafleet.protocol.names import NAME_PATTERN
from lorafleet.protocol.router import ADAPTER_HEADER
from lorafleet.protocol.tenants import adapter_of
from tests.tenants.conftest import ALICE, API_KEY, BOB, bearer
from tests.tenants.test_tenants_router import _body

OWNER = {ALICE: "alice-", BOB: "bob-"}
GENERATION = ["/v1/completions", "/v1/chat/completions", "/generate", "/inference/v1/generate"]
NAMES = st.one_of(
    st.sampled_from(
        [
            "alice-x",
            "bob-y",
            "alice-x@v1",
            "bob-y@v1",
            "bob-y@v2",
            "bob-y-v1",
            "alice-x-v1",
            "Alice-x",
            "alice-",
            "bob-y@v01",
        ]
    ),
    st.from_regex(NAME_PATTERN, fullmatch=True).map(lambda s: s[:40]),
    st.from_regex(rf"(alice-|bob-){NAME_PATTERN[:-1]}", fullmatch=True).map(lambda s: s[:40]),
    st.text(max_size=20),
)
TOKENS = st.sampled_from([ALICE, BOB, None, "not-a-tenant", API_KEY])


def _owned(token: str, model: str, base: str) -> bool:
    """Whether ``model`` is the tenant's (or the base model), as the router decides it; a
    SGLang trainer name (``alice-x-v1``) counts by the name it stands for."""
    return model == base or adapter_of(model).startswith(OWNER[token])


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    token=TOKENS,
    names=st.lists(NAMES, min_size=1, max_size=2),
    route=st.sampled_from(
        [*GENERATION, "/generate-sglang", "control-put", "control-delete", "register"]
    ),
)
def test_a_tenant_never_reaches_a_name_not_its_own(tenant_fleet, token, names, route):
    table = tenant_fleet.table()
    stores = tenant_fleet.stores()
    name = names[0]
    if route == "register":
        # The one control route a tenant may call: its own names only, and this router has
        # no directory to register from, so nothing may ever be written.
        r = httpx.post(
            tenant_fleet.url + "/v1/control/registrations",
            json={"name": name, "path": "/etc"},
            headers=bearer(token),
            timeout=30,
        )
        assert r.status_code in (400, 401, 403, 404), r.text
        if token in OWNER and r.status_code != 400 and not _owned(token, name, ""):
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    elif route.startswith("control-"):
        url = tenant_fleet.url + "/v1/control/aliases/" + quote(name, safe="")
        body = {"version": 9, "engine_name": "alice-x@v1", "replicas": ["r0"]}
        if route == "control-put":
            r = httpx.put(url, json=body, headers=bearer(token), timeout=30)
        else:
            r = httpx.delete(url, headers=bearer(token), timeout=30)
        assert r.status_code in (400, 401, 403, 404, 405), r.text
    else:
        model: str | list[str] = names if route == "/generate" and len(names) > 1 else name
        r = httpx.post(
            tenant_fleet.url + ("/generate" if route == "/generate-sglang" else route),
            json=_body(route, model),
            headers=bearer(token),
            timeout=60,
        )
        models = model if isinstance(model, list) else [model]
        if token is None:
            assert r.status_code == 401, r.text
        elif token == "not-a-tenant":
            assert r.status_code == 403, r.text
        elif token in OWNER and not all(_owned(token, m, tenant_fleet.base_model) for m in models):
            assert r.status_code in (400, 404), r.text
            assert r.json()["error"]["code"] in ("not_found", "invalid_name", "invalid_request")
            assert ADAPTER_HEADER not in r.headers
        if r.status_code == 200 and token in OWNER:
            assert all(_owned(token, m, tenant_fleet.base_model) for m in models), r.text
    assert tenant_fleet.table() == table
    assert tenant_fleet.stores() == stores
