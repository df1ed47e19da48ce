"""Every bad input gets its precise status and code, and changes nothing on disk."""

from __future__ import annotations

import base64
import hashlib
import json
import os

import httpx
import pytest

from lorafleet.protocol.manifest import FileEntry, Manifest
from lorafleet.testing import wait_until
from tests.agent.helpers import auth, put_cut, snapshot

CFG = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "peft_type": "LORA"}


def _manifest(name="bad", version=1, files=None) -> dict:
    cfg_bytes = json.dumps(CFG).encode()
    files = files or [
        {"path": "adapter_config.json", "size": len(cfg_bytes), "sha256": _sha(cfg_bytes)}
    ]
    return {"name": name, "version": version, "config": CFG, "files": files}


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _open(server, manifest: dict, headers=None) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/uploads",
        json={"manifest": manifest},
        headers=auth(server) if headers is None else headers,
    )


def _expect(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert r.headers["X-Lorafleet-Error-Code"] == code


@pytest.fixture
def unchanged(agent):
    """Assert the store is byte-for-byte unchanged and staging empty after the test body."""
    before = snapshot(agent.spec.data_dir)
    yield agent
    after = snapshot(agent.spec.data_dir)
    assert after["staging_bytes"] == 0
    assert after["files"] == before["files"]


DATA = os.urandom(256 << 10)
WEIGHTS = {"path": "adapter_model.safetensors", "size": len(DATA), "sha256": _sha(DATA)}


def _session(agent, files=None) -> str:
    r = _open(agent, _manifest(files=files or [WEIGHTS]))
    assert r.status_code == 201, r.text
    return r.json()["upload_id"]


def _put(agent, uid, body, headers=None, path="adapter_model.safetensors"):
    return httpx.put(
        f"{agent.url}/v1/uploads/{uid}/files/{path}",
        content=body,
        headers={**auth(agent), **(headers or {})},
    )


def test_flipped_byte(unchanged):
    a = unchanged
    uid = _session(a)
    bad = bytearray(DATA)
    bad[1000] ^= 1
    r = _put(a, uid, bytes(bad))
    _expect(r, 422, "digest_mismatch")
    assert WEIGHTS["sha256"] in r.json()["error"]["message"]
    assert _sha(bytes(bad)) in r.json()["error"]["message"]
    assert "adapter_model.safetensors" in r.json()["error"]["message"]
    assert snapshot(a.spec.data_dir)["staging_bytes"] == 0
    # the same file can be sent again correctly, then the session discarded
    assert _put(a, uid, DATA).status_code == 200
    assert httpx.delete(f"{a.url}/v1/uploads/{uid}", headers=auth(a)).status_code == 204


def test_truncated(unchanged):
    uid = _session(unchanged)
    r = _put(unchanged, uid, DATA[:-10])
    _expect(r, 422, "size_mismatch")
    assert str(len(DATA)) in r.json()["error"]["message"]
    httpx.delete(f"{unchanged.url}/v1/uploads/{uid}", headers=auth(unchanged))


def test_lying_size_content_length(unchanged):
    uid = _session(unchanged)
    _expect(_put(unchanged, uid, DATA + b"x" * 100), 413, "size_exceeded")
    httpx.delete(f"{unchanged.url}/v1/uploads/{uid}", headers=auth(unchanged))


def test_lying_size_streamed(unchanged):
    """Chunked body (no Content-Length): stopped the moment it passes the declared size."""
    uid = _session(unchanged)

    def gen():
        yield DATA
        yield b"x" * 100

    _expect(_put(unchanged, uid, gen()), 413, "size_exceeded")
    httpx.delete(f"{unchanged.url}/v1/uploads/{uid}", headers=auth(unchanged))


def test_repr_digest_mismatch(unchanged):
    uid = _session(unchanged)
    other = base64.b64encode(hashlib.sha256(b"other").digest()).decode()
    r = _put(unchanged, uid, DATA, {"Repr-Digest": f"sha-256=:{other}:"})
    _expect(r, 422, "digest_mismatch")
    httpx.delete(f"{unchanged.url}/v1/uploads/{uid}", headers=auth(unchanged))


def test_content_digest(unchanged):
    uid = _session(unchanged)
    wrong = base64.b64encode(hashlib.sha256(b"other").digest()).decode()
    _expect(
        _put(unchanged, uid, DATA, {"Content-Digest": f"sha-256=:{wrong}:"}), 422, "digest_mismatch"
    )
    right = base64.b64encode(hashlib.sha256(DATA).digest()).decode()
    assert _put(unchanged, uid, DATA, {"Content-Digest": f"sha-256=:{right}:"}).status_code == 200
    httpx.delete(f"{unchanged.url}/v1/uploads/{uid}", headers=auth(unchanged))


@pytest.mark.parametrize(
    ("path", "code"),
    [
        ("README.md", "file_not_allowed"),
        ("../adapter_config.json", "path_escape"),
        ("/etc/passwd", "path_escape"),
        ("a/../../adapter_config.json", "path_escape"),
    ],
)
def test_bad_paths(unchanged, path, code):
    files = [{"path": path, "size": 10, "sha256": _sha(b"0123456789")}]
    _expect(_open(unchanged, _manifest(files=files)), 400, code)


def test_no_token_and_wrong_token(unchanged):
    _expect(_open(unchanged, _manifest(), headers={}), 401, "unauthorized")
    _expect(
        _open(unchanged, _manifest(), headers={"Authorization": "Bearer nope"}), 403, "forbidden"
    )
    r = httpx.put(f"{unchanged.url}/v1/uploads/x/files/adapter_config.json", content=b"12")
    _expect(r, 401, "unauthorized")
    r = httpx.post(f"{unchanged.url}/v1/adapters/unload", json={"name": "x", "version": 1})
    _expect(r, 401, "unauthorized")


def test_huge_json(unchanged):
    big = {"manifest": _manifest(), "pad": "x" * (2 << 20)}
    r = httpx.post(unchanged.url + "/v1/uploads", json=big, headers=auth(unchanged))
    _expect(r, 413, "body_too_large")


def test_unknown_adapter_and_upload(unchanged):
    r = httpx.post(
        unchanged.url + "/v1/adapters/unload",
        json={"name": "nope", "version": 1},
        headers=auth(unchanged),
    )
    _expect(r, 404, "adapter_not_found")
    _expect(_put(unchanged, "nope", b"x"), 404, "upload_not_found")


def test_commit_incomplete_and_publish_in_progress(unchanged):
    uid = _session(unchanged)
    # another bundle for the same name while the session is open: refused
    _expect(_open(unchanged, _manifest(version=2, files=[WEIGHTS])), 409, "publish_in_progress")
    # the same bundle again is the same session (a lost answer to the first open)
    assert _open(unchanged, _manifest(files=[WEIGHTS])).json()["upload_id"] == uid
    r = httpx.post(f"{unchanged.url}/v1/uploads/{uid}/commit", headers=auth(unchanged))
    _expect(r, 409, "upload_incomplete")
    assert (
        httpx.delete(f"{unchanged.url}/v1/uploads/{uid}", headers=auth(unchanged)).status_code
        == 204
    )


def test_invalid_adapter_committed_leaves_nothing(unchanged):
    """A file set that is not an adapter: 422 adapter_invalid, blobs and dir removed."""
    uid = _session(unchanged)
    assert _put(unchanged, uid, DATA).status_code == 200  # random bytes, not safetensors
    r = httpx.post(f"{unchanged.url}/v1/uploads/{uid}/commit", headers=auth(unchanged))
    _expect(r, 422, "adapter_invalid")


def test_over_the_file_cap(agent_factory):
    a = agent_factory("--max-file-bytes", "1000")
    before = snapshot(a.spec.data_dir)
    r = _open(a, _manifest(files=[WEIGHTS]))
    _expect(r, 413, "file_too_large")
    assert snapshot(a.spec.data_dir) == before


def test_over_the_quota(agent_factory):
    a = agent_factory("--quota-bytes", str(100 << 10))
    before = snapshot(a.spec.data_dir)
    r = _open(a, _manifest(files=[WEIGHTS]))
    _expect(r, 507, "quota_exceeded")
    msg = r.json()["error"]["message"]
    assert str(len(DATA)) in msg and str(100 << 10) in msg
    assert snapshot(a.spec.data_dir) == before


def test_shared_fs_register(agent_factory, peft_dir, tmp_path):
    import shutil

    from lorafleet.bundle import AdapterBundle

    allowed = tmp_path / "shared"
    shutil.copytree(peft_dir, allowed / "a")
    a = agent_factory("--shared-fs-allow", str(allowed))
    bundle = AdapterBundle.from_dir(allowed / "a", name="shared", version=1)
    body = {"manifest": bundle.manifest.model_dump(mode="json")}
    before = snapshot(a.spec.data_dir)
    # outside the allow-list, including through a symlink
    r = httpx.post(
        a.url + "/v1/adapters/register", json={**body, "path": str(peft_dir)}, headers=auth(a)
    )
    _expect(r, 403, "path_not_allowed")
    (allowed / "link").symlink_to(peft_dir)
    r = httpx.post(
        a.url + "/v1/adapters/register",
        json={**body, "path": str(allowed / "link")},
        headers=auth(a),
    )
    _expect(r, 403, "path_not_allowed")
    # a tampered file is refused
    w = allowed / "a" / "adapter_model.safetensors"
    orig = w.read_bytes()
    w.write_bytes(orig[:-1] + bytes([orig[-1] ^ 1]))
    r = httpx.post(
        a.url + "/v1/adapters/register", json={**body, "path": str(allowed / "a")}, headers=auth(a)
    )
    _expect(r, 422, "digest_mismatch")
    assert snapshot(a.spec.data_dir) == before
    w.write_bytes(orig)
    r = httpx.post(
        a.url + "/v1/adapters/register", json={**body, "path": str(allowed / "a")}, headers=auth(a)
    )
    assert r.status_code == 200, r.text
    # ingested, not borrowed: the trainer overwriting its file changes nothing we serve
    w.write_bytes(b"overwritten")
    from pathlib import Path

    assert (Path(r.json()["path"]) / "adapter_model.safetensors").read_bytes() == orig
    r = httpx.post(
        a.url + "/v1/adapters/unload", json={"name": "shared", "version": 1}, headers=auth(a)
    )
    assert r.status_code == 200


def test_ttl_reaping(agent_factory):
    """An idle session is reaped: both the blob it added and its partial upload are removed."""
    a = agent_factory("--upload-ttl", "2")
    before = snapshot(a.spec.data_dir)
    cfg = json.dumps(CFG).encode()
    uid = _session(a, files=[WEIGHTS, _manifest()["files"][0]])
    assert _put(a, uid, cfg, path="adapter_config.json").status_code == 200  # a blob added
    # A partial upload of the weights: the connection drops part way. More than the server's
    # 64 KiB read buffer is sent, so the agent reads (and keeps) bytes before it sees the drop.
    cut = 100_000
    put_cut(a, uid, WEIGHTS["path"], DATA, cut_after=cut)
    url = f"{a.url}/v1/uploads/{uid}/files/{WEIGHTS['path']}"
    offset = 0

    def partial_is_durable() -> bool:  # HEAD also keeps the session alive meanwhile
        nonlocal offset
        offset = int(httpx.head(url, headers=auth(a)).headers["Upload-Offset"])
        return offset > 0

    wait_until(partial_is_durable, message="the cut upload left no durable bytes")
    during = snapshot(a.spec.data_dir)
    assert 0 < offset <= cut and during["staging_bytes"] == offset
    assert f"blobs/sha256/{_sha(cfg)}" in set(during["files"]) - set(before["files"])
    wait_until(
        lambda: httpx.get(f"{a.url}/v1/uploads/{uid}", headers=auth(a)).status_code == 404,
        message="upload not reaped",
    )
    assert snapshot(a.spec.data_dir) == before
    assert "lorafleet_agent_reaped_uploads_total 1.0" in httpx.get(a.url + "/metrics").text


def test_startup_clears_stale_staging(agent_factory, tmp_path):
    d = tmp_path / "stale"
    (d / "staging" / "deadbeef").mkdir(parents=True)
    (d / "staging" / "deadbeef" / "adapter_model.safetensors.partial").write_bytes(b"x" * 4096)
    a = agent_factory(data_dir=d)
    assert snapshot(a.spec.data_dir)["staging_bytes"] == 0
    assert list((d / "staging").iterdir()) == []


def test_manifest_entries_are_models():
    # FileEntry/Manifest accept what the tests send (guards the helper above)
    Manifest.model_validate(_manifest(files=[WEIGHTS]))
    FileEntry.model_validate(WEIGHTS)
