"""One relay hop between two real agents: the forward plan, the per-publication credential and
what it opens (one session's PUT and HEAD, nothing else), and refusals of bad plans."""

from __future__ import annotations

import hashlib
import json
import os
import secrets

import httpx
import pytest

from lorafleet.protocol.agent import credential_digest
from tests.agent.helpers import auth, snapshot

CFG = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "peft_type": "LORA"}
DATA = os.urandom(3 << 20)
PATH = "adapter_model.safetensors"


def _manifest(name: str = "hop") -> dict:
    cfg = json.dumps(CFG).encode()
    return {
        "name": name,
        "version": 1,
        "config": CFG,
        "files": [
            {"path": "adapter_config.json", "size": len(cfg), "sha256": _sha(cfg)},
            {"path": PATH, "size": len(DATA), "sha256": _sha(DATA)},
        ],
    }


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _open(agent, credential: str | None, name: str = "hop") -> str:
    body: dict = {"manifest": _manifest(name)}
    if credential:
        body["relay"] = {"credential_sha256": credential_digest(credential), "stall_s": 2}
    r = httpx.post(agent.url + "/v1/uploads", json=body, headers=auth(agent))
    assert r.status_code == 201, r.text
    return r.json()["upload_id"]


def _plan(credential: str, targets: list[dict], path: str = PATH) -> dict:
    return {"credential": credential, "stall_s": 2, "files": {path: targets}}


def _target(agent, uid: str) -> dict:
    return {"url": agent.url, "upload_id": uid, "answer_timeout_s": 30}


@pytest.fixture
def pair(agent_factory):
    return agent_factory(token="control-a"), agent_factory(token="control-b")


def test_one_put_reaches_both_agents_verified(pair):
    a, b = pair
    cred = secrets.token_urlsafe(32)
    ua, ub = _open(a, cred), _open(b, cred)
    r = httpx.post(
        f"{a.url}/v1/uploads/{ua}/forward", json=_plan(cred, [_target(b, ub)]), headers=auth(a)
    )
    assert r.status_code == 200, r.text
    r = httpx.put(f"{a.url}/v1/uploads/{ua}/files/{PATH}", content=DATA, headers=auth(a))
    assert r.status_code == 200, r.text
    prog = r.json()
    [hop] = prog["relayed"]
    seconds = hop.pop("seconds")  # its own copy, from its first byte to its verdict
    assert prog["complete"] and hop == {
        "url": b.url,
        "upload_id": ub,
        "path": PATH,
        "ok": True,
        "code": None,
        "detail": None,
    }
    assert 0 < seconds < 60
    st = httpx.get(f"{b.url}/v1/uploads/{ub}", headers=auth(b)).json()
    weights = next(f for f in st["files"] if f["path"] == PATH)
    assert weights["complete"] and weights["offset"] == len(DATA) and not weights["receiving"]
    metrics = httpx.get(a.url + "/metrics").text
    assert 'lorafleet_agent_relay_hops_total{outcome="ok"} 1.0' in metrics


def test_the_credential_opens_one_session_for_put_and_head_only(pair):
    _, b = pair
    cred = secrets.token_urlsafe(32)
    ub = _open(b, cred)
    other = _open(b, None, name="other")  # a session opened without relay
    peer = {"Authorization": f"Bearer {cred}"}
    head = httpx.head(f"{b.url}/v1/uploads/{ub}/files/{PATH}", headers=peer)
    assert head.status_code == 200 and head.headers["Upload-Offset"] == "0"
    for method, url in [
        ("HEAD", f"{b.url}/v1/uploads/{other}/files/{PATH}"),
        ("PUT", f"{b.url}/v1/uploads/{other}/files/{PATH}"),
        ("GET", f"{b.url}/v1/uploads/{ub}"),
        ("POST", f"{b.url}/v1/uploads/{ub}/commit"),
        ("DELETE", f"{b.url}/v1/uploads/{ub}"),
        ("POST", f"{b.url}/v1/adapters/load"),
    ]:
        r = httpx.request(method, url, headers=peer, content=b"x" if method == "PUT" else None)
        assert r.status_code == 403, (method, url, r.status_code, r.text)
    # After the session ends the credential opens nothing, not even its old session.
    assert httpx.delete(f"{b.url}/v1/uploads/{ub}", headers=auth(b)).status_code == 204
    r = httpx.put(f"{b.url}/v1/uploads/{ub}/files/{PATH}", content=DATA, headers=peer)
    assert r.status_code == 403
    assert httpx.delete(f"{b.url}/v1/uploads/{other}", headers=auth(b)).status_code == 204


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda p, uid: p["files"][PATH][0].update(url="http://127.0.0.1:1/x"), "path"),
        (lambda p, uid: p["files"][PATH][0].update(url="ftp://127.0.0.1:1"), "http"),
        (lambda p, uid: p["files"][PATH][0].update(url="http://u:p@127.0.0.1:1"), "user"),
        (lambda p, uid: p["files"][PATH][0].update(upload_id="../../etc"), "pattern"),
        (lambda p, uid: p["files"][PATH][0].update(upload_id=uid), "itself"),
        (lambda p, uid: p["files"].update({"nope.bin": p["files"][PATH]}), "about to receive"),
        (lambda p, uid: p["files"][PATH].extend(p["files"][PATH] * 16), "at most"),
        (lambda p, uid: p["files"][PATH].append(dict(p["files"][PATH][0])), "twice"),
        (lambda p, uid: p.update(credential="short"), "credential"),
    ],
)
def test_bad_forward_plans_are_refused_and_leave_nothing(pair, edit, why):
    a, b = pair
    before = snapshot(a.spec.data_dir)
    cred = secrets.token_urlsafe(32)
    ua, ub = _open(a, cred), _open(b, cred)
    plan = _plan(cred, [_target(b, ub)])
    edit(plan, ua)
    r = httpx.post(f"{a.url}/v1/uploads/{ua}/forward", json=plan, headers=auth(a))
    assert r.status_code == 400, r.text
    assert why in r.text
    # The session still takes a plain upload, which then forwards nowhere.
    r = httpx.put(f"{a.url}/v1/uploads/{ua}/files/{PATH}", content=DATA, headers=auth(a))
    assert r.status_code == 200 and r.json()["relayed"] == []
    for agent, uid in ((a, ua), (b, ub)):
        assert httpx.delete(f"{agent.url}/v1/uploads/{uid}", headers=auth(agent)).status_code == 204
    after = snapshot(a.spec.data_dir)
    assert after["staging_bytes"] == 0 and after["files"] == before["files"]


def test_a_forward_plan_needs_the_control_token(pair):
    a, b = pair
    cred = secrets.token_urlsafe(32)
    ua, ub = _open(a, cred), _open(b, cred)
    plan = _plan(cred, [_target(b, ub)])
    for headers in ({}, {"Authorization": f"Bearer {cred}"}):
        r = httpx.post(f"{a.url}/v1/uploads/{ua}/forward", json=plan, headers=headers)
        assert r.status_code in (401, 403), r.text


def test_a_corrupt_upstream_copy_is_refused_at_both_hops(pair):
    """The forwarder passes on what it received; each hop judges its own copy."""
    a, b = pair
    cred = secrets.token_urlsafe(32)
    ua, ub = _open(a, cred), _open(b, cred)
    httpx.post(
        f"{a.url}/v1/uploads/{ua}/forward", json=_plan(cred, [_target(b, ub)]), headers=auth(a)
    ).raise_for_status()
    bad = bytearray(DATA)
    bad[12345] ^= 1
    r = httpx.put(f"{a.url}/v1/uploads/{ua}/files/{PATH}", content=bytes(bad), headers=auth(a))
    assert r.status_code == 422 and r.json()["error"]["code"] == "digest_mismatch"
    st = httpx.get(f"{a.url}/v1/uploads/{ua}", headers=auth(a)).json()
    hop = next(f for f in st["files"] if f["path"] == PATH)["relayed"]
    assert [(h["ok"], h["code"]) for h in hop] == [(False, "digest_mismatch")]
    st = httpx.get(f"{b.url}/v1/uploads/{ub}", headers=auth(b)).json()
    weights = next(f for f in st["files"] if f["path"] == PATH)
    assert (weights["offset"], weights["error_code"]) == (0, "digest_mismatch")
    for agent in (a, b):
        assert snapshot(agent.spec.data_dir)["staging_bytes"] == 0
