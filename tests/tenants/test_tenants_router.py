"""The router with tenants: a tenant's token generates with its own adapters only; every other
name is answered exactly as a name that does not exist, and nothing reaches an engine."""

from __future__ import annotations

import httpx
import pytest

from lorafleet.protocol.errors import ERROR_CODE_HEADER
from lorafleet.protocol.router import ADAPTER_HEADER
from lorafleet.testing import start_dataplane, wait_until
from tests.tenants.conftest import ALICE, API_KEY, BOB, TenantFleet, bearer

MISSING = "alice-nothing-here"
"""A name alice would own, published by nobody."""


def _body(path: str, model: str | list[str]) -> dict:
    if path == "/v1/chat/completions":
        return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if path == "/generate" and isinstance(model, list):
        return {"text": ["a", "b"][: len(model)], "lora_path": model, "sampling_params": {}}
    if path == "/generate-sglang":
        return {"text": "hi", "lora_path": model, "sampling_params": {"max_new_tokens": 2}}
    if path in ("/generate", "/inference/v1/generate"):
        return {"model": model, "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
    return {"model": model, "prompt": "hi", "max_tokens": 2}


def _post(tf: TenantFleet, path: str, model, token: str | None) -> httpx.Response:
    route = "/generate" if path == "/generate-sglang" else path
    return httpx.post(tf.url + route, json=_body(path, model), headers=bearer(token), timeout=60)


def _refusal(r: httpx.Response) -> tuple[int, str | None, str, str | None]:
    err = r.json()["error"]
    return r.status_code, r.headers.get(ERROR_CODE_HEADER), err["code"], err["param"]


def test_a_tenant_generates_with_its_own_adapter(tenant_fleet):
    r = _post(tenant_fleet, "/v1/completions", "alice-x", ALICE)
    assert r.status_code == 200, r.text
    assert r.headers[ADAPTER_HEADER] == "alice-x"
    r = _post(tenant_fleet, "/v1/completions", "bob-y@v1", BOB)
    assert r.status_code == 200, r.text
    assert r.headers[ADAPTER_HEADER] == "bob-y"


def test_a_tenant_may_use_the_base_model(tenant_fleet):
    r = _post(tenant_fleet, "/v1/completions", tenant_fleet.base_model, ALICE)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("path", "other"),
    [
        ("/v1/completions", "bob-y"),
        ("/v1/completions", "bob-y@v1"),
        ("/v1/completions", "bob-y@v7"),
        ("/v1/completions", "bob-never-published"),
        ("/v1/chat/completions", "bob-y"),
        ("/generate", "bob-y"),
        ("/inference/v1/generate", "bob-y@v1"),
        ("/generate-sglang", "bob-y"),
        ("/generate-sglang", "bob-y-v1"),
        ("/generate-sglang", "bob-y@v1"),
    ],
)
def test_another_tenants_name_is_answered_as_a_missing_name(tenant_fleet, path, other):
    before = tenant_fleet.engine_requests()
    missing = _post(tenant_fleet, path, MISSING, ALICE)
    refused = _post(tenant_fleet, path, other, ALICE)
    assert missing.status_code == 404, missing.text
    assert _refusal(refused) == _refusal(missing)
    assert refused.json()["error"]["message"] == missing.json()["error"]["message"].replace(
        MISSING, other
    )
    assert ADAPTER_HEADER not in refused.headers
    assert tenant_fleet.engine_requests() == before, "nothing may reach an engine"
    # The operator's key reaches bob's adapter under the same name.
    if other in ("bob-y", "bob-y@v1"):
        assert _post(tenant_fleet, path, other, API_KEY).status_code == 200


def test_a_batch_naming_one_other_tenants_adapter_is_refused_whole(tenant_fleet):
    before = tenant_fleet.engine_requests()
    missing = _post(tenant_fleet, "/generate", ["alice-x", MISSING], ALICE)
    refused = _post(tenant_fleet, "/generate", ["alice-x", "bob-y"], ALICE)
    assert missing.status_code == 404
    assert _refusal(refused) == _refusal(missing)
    # The batch with a missing name may have sent alice-x's prompt on; bob's sent nothing more.
    after_missing = tenant_fleet.engine_requests()
    assert _post(tenant_fleet, "/generate", ["alice-x", "bob-y"], ALICE).status_code == 404
    assert tenant_fleet.engine_requests() == after_missing
    assert after_missing == before


def test_models_lists_the_tenants_names_and_the_base_model(tenant_fleet):
    def ids(token: str) -> set[str]:
        r = httpx.get(tenant_fleet.url + "/v1/models", headers=bearer(token), timeout=10)
        r.raise_for_status()
        return {m["id"] for m in r.json()["data"]}

    base = tenant_fleet.base_model
    assert ids(ALICE) == {base, "alice-x"}
    assert ids(BOB) == {base, "bob-y"}
    assert ids(API_KEY) == {base, "alice-x", "bob-y"}


@pytest.mark.parametrize(
    ("headers", "status"),
    [({}, 401), ({"Authorization": "Basic YWxpY2U="}, 401), (bearer("nobody's-token"), 403)],
)
def test_a_request_without_a_known_token_is_refused(tenant_fleet, headers, status):
    body = _body("/v1/completions", "alice-x")
    r = httpx.post(tenant_fleet.url + "/v1/completions", json=body, headers=headers, timeout=10)
    assert r.status_code == status, r.text
    r = httpx.get(tenant_fleet.url + "/v1/models", headers=headers, timeout=10)
    assert r.status_code == status, r.text


def test_tenant_tokens_are_refused_on_the_control_plane(tenant_fleet):
    table = tenant_fleet.table()
    for token in (ALICE, BOB, API_KEY):
        h = bearer(token)
        url = tenant_fleet.url + "/v1/control/aliases"
        assert httpx.get(url, headers=h, timeout=10).status_code == 403
        assert httpx.delete(url + "/alice-x", headers=h, timeout=10).status_code == 403
        body = {"version": 9, "engine_name": "alice-x@v1", "replicas": ["r"]}
        assert httpx.put(url + "/alice-x", json=body, headers=h, timeout=10).status_code == 403
    assert tenant_fleet.table() == table


def test_a_tenant_may_not_abort_everything(tenant_fleet):
    url = tenant_fleet.url + "/abort_request"
    r = httpx.post(url, json={"rid": "", "abort_all": True}, headers=bearer(ALICE), timeout=10)
    assert r.status_code == 403
    r = httpx.post(url, json={"rid": "x", "abort_all": False}, headers=bearer(ALICE), timeout=10)
    assert r.status_code == 200


def test_a_data_plane_copy_scopes_tenants_alike(tenant_fleet, launcher):
    copy = start_dataplane(
        launcher,
        tenant_fleet.router,
        token=tenant_fleet.fleet.token,
        api_key=API_KEY,
        health_interval=0.2,
        extra=("--tenants", str(tenant_fleet.tenants_file)),
    )

    def served() -> bool:
        r = httpx.post(
            copy.url + "/v1/completions",
            json=_body("/v1/completions", "alice-x"),
            headers=bearer(ALICE),
            timeout=30,
        )
        return r.status_code == 200

    wait_until(served, message="the copy serves alice-x to alice")
    before = tenant_fleet.engine_requests()
    r = httpx.post(
        copy.url + "/v1/completions",
        json=_body("/v1/completions", "bob-y"),
        headers=bearer(ALICE),
        timeout=30,
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert tenant_fleet.engine_requests() == before
    r = httpx.get(copy.url + "/v1/models", headers=bearer(ALICE), timeout=10)
    assert {m["id"] for m in r.json()["data"]} == {tenant_fleet.base_model, "alice-x"}
