"""Upload, commit, load, serve; dedup; resume after a cut connection; lifecycle; restart."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from lorafleet.bundle import AdapterBundle
from lorafleet.clients.agent import AsyncAgentClient
from lorafleet.errors import RemoteError
from lorafleet.testing import wait_until
from tests.agent.helpers import auth, completion, put_cut, snapshot


def publish(server, bundle: AdapterBundle, mode: str = "versioned", load: bool = True):
    """Upload every missing file of ``bundle``, commit, and (optionally) load it."""

    async def go():
        async with AsyncAgentClient(server.url, server.spec.token) as c:
            sess = await c.open_upload(bundle.manifest)
            for path in sess.missing:
                entry = bundle.manifest.file(path)
                await c.upload_file(sess.upload_id, entry, _source(bundle, path))
            rec = await c.commit(sess.upload_id)
            if load:
                rec = await c.load(bundle.name, bundle.version, mode)
            return sess, rec

    return asyncio.run(go())


def _source(bundle: AdapterBundle, path: str):
    src = bundle.source(path)
    return src  # a Path (streamed in chunks) or bytes


def call(server, coro_fn):
    async def go():
        async with AsyncAgentClient(server.url, server.spec.token) as c:
            return await coro_fn(c)

    return asyncio.run(go())


def test_upload_commit_load_serves(agent, engine, peft_dir):
    _kind, eng = engine
    bundle = AdapterBundle.from_dir(peft_dir, name="flow", version=1)
    sess, rec = publish(agent, bundle)
    assert sorted(sess.missing) == sorted(f.path for f in bundle.files)
    assert rec.state == "loaded" and rec.engine_name == "flow@v1"
    try:
        assert completion(eng.url, "flow@v1") != completion(eng.url, "tiny")
        rec = call(agent, lambda c: c.activate("flow", 1))
        assert rec.state == "active"
        listed = call(agent, lambda c: c.list_adapters())
        assert [(r.name, r.version, r.state.value) for r in listed] == [("flow", 1, "active")]
        # the adapter directory is made of hard links into the blob store
        for f in bundle.files:
            assert (agent.spec.data_dir / "blobs" / "sha256" / f.sha256).stat().st_nlink == 2
        # dedup: the same files again need no bytes
        b2 = bundle.with_version(2)
        sess2, rec2 = publish(agent, b2)
        assert sess2.missing == [] and sorted(sess2.present) == sorted(f.path for f in b2.files)
        assert rec2.state == "loaded"
        # a version not newer than a loaded one is refused
        with pytest.raises(RemoteError) as ei:
            call(
                agent,
                lambda c: c.open_upload(
                    bundle.with_version(1, name="flow").manifest.model_copy(
                        update={"config": {**bundle.config, "x": 1}}
                    )
                ),
            )
        assert ei.value.status == 409
        call(agent, lambda c: c.unload("flow", 2))
    finally:
        call(agent, lambda c: c.unload("flow", 1))
    snap = snapshot(agent.spec.data_dir)
    assert snap["files"] == {} and snap["staging_bytes"] == 0
    # after v1 is removed (rollback), publishing v1 again works
    publish(agent, bundle, load=False)
    call(agent, lambda c: c.unload("flow", 1))


def test_resume_after_cut_connection(agent, tmp_path):
    import hashlib
    import json
    import os

    weights = os.urandom(3 << 20)
    d = tmp_path / "big"
    d.mkdir()
    (d / "adapter_model.safetensors").write_bytes(weights)
    cfg = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "peft_type": "LORA"}
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    bundle = AdapterBundle.from_dir(d, name="resume", version=1)
    sess = call(agent, lambda c: c.open_upload(bundle.manifest))
    entry = bundle.manifest.file("adapter_model.safetensors")
    put_cut(agent, sess.upload_id, entry.path, weights, cut_after=(2 << 20) + 12345)
    h = auth(agent)
    url = f"{agent.url}/v1/uploads/{sess.upload_id}/files/{entry.path}"

    def durable_offset() -> int:
        r = httpx.head(url, headers=h)
        assert r.status_code == 200
        return int(r.headers["Upload-Offset"])

    # the agent notices the cut asynchronously
    offset = wait_until(durable_offset, timeout=10, message="the cut upload's offset durable")
    assert 0 < offset <= (2 << 20) + 12345
    # a wrong offset is refused with the durable one
    r = httpx.put(url, headers={**h, "Upload-Offset": "1"}, content=weights[1:])
    assert r.status_code == 409 and r.json()["error"]["code"] == "offset_mismatch"
    assert r.headers["Upload-Offset"] == str(offset)
    digest = hashlib.sha256(weights).digest()
    import base64

    r = httpx.put(
        url,
        headers={
            **h,
            "Upload-Offset": str(offset),
            "Repr-Digest": f"sha-256=:{base64.b64encode(digest).decode()}:",
        },
        content=weights[offset:],
    )
    assert r.status_code == 200, r.text
    assert r.json()["complete"] is True
    # the verified bytes are in the blob store, exactly
    blob = agent.spec.data_dir / "blobs" / "sha256" / entry.sha256
    assert blob.read_bytes() == weights
    assert snapshot(agent.spec.data_dir)["staging_bytes"] == 0
    call(agent, lambda c: c.discard(sess.upload_id))
    assert not blob.exists()


def test_client_resumes_through_a_flaky_proxy(agent, tmp_path):
    """AsyncAgentClient resumes by itself when the connection drops mid-file."""
    import os

    data = os.urandom(4 << 20)
    cfg = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "peft_type": "LORA"}
    d = tmp_path / "flaky"
    d.mkdir()
    (d / "adapter_model.safetensors").write_bytes(data)
    import json

    (d / "adapter_config.json").write_text(json.dumps(cfg))
    bundle = AdapterBundle.from_dir(d, name="flaky", version=1)
    port_holder: dict = {}

    async def go():
        cuts = {"left": 1}
        up_host, up_port = agent.url.removeprefix("http://").split(":")

        async def handle(reader, writer):
            ur, uw = await asyncio.open_connection(up_host, int(up_port))
            budget = [2 << 20] if cuts["left"] > 0 else [None]
            if cuts["left"] > 0:
                cuts["left"] -= 1

            async def pump(src, dst, limit):
                try:
                    while True:
                        chunk = await src.read(65536)
                        if not chunk:
                            break
                        if limit is not None:
                            limit[0] -= len(chunk)
                            if limit[0] < 0:
                                break
                        dst.write(chunk)
                        await dst.drain()
                finally:
                    dst.close()
                    if limit is not None:
                        writer.close()
                        uw.close()

            await asyncio.gather(
                pump(reader, uw, budget if budget[0] else None),
                pump(ur, writer, None),
                return_exceptions=True,
            )

        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port_holder["port"] = srv.sockets[0].getsockname()[1]
        try:
            async with AsyncAgentClient(
                f"http://127.0.0.1:{port_holder['port']}", agent.spec.token
            ) as c:
                sess = await c.open_upload(bundle.manifest)
                for p in sess.missing:
                    await c.upload_file(sess.upload_id, bundle.manifest.file(p), bundle.source(p))
                status = await c.upload_status(sess.upload_id)
                await c.discard(sess.upload_id)
                return status
        finally:
            srv.close()

    status = asyncio.run(go())
    assert all(f.complete for f in status.files)
    assert snapshot(agent.spec.data_dir) == {"staging_bytes": 0, "files": {}}


def test_agent_restart_keeps_desired_state(agent_factory, engine, peft_dir):
    _kind, eng = engine
    a1 = agent_factory()
    bundle = AdapterBundle.from_dir(peft_dir, name="keep", version=1)
    publish(a1, bundle)
    call(a1, lambda c: c.activate("keep", 1))
    a1.proc.stop()
    a2 = agent_factory(data_dir=a1.spec.data_dir, token=a1.spec.token)
    try:
        listed = call(a2, lambda c: c.list_adapters())
        assert [(r.name, r.version, r.state.value) for r in listed] == [("keep", 1, "active")]
        assert completion(eng.url, "keep@v1") != completion(eng.url, "tiny")
    finally:
        call(a2, lambda c: c.unload("keep", 1))


def test_rank_over_engine_limit_refused_before_load(agent, peft_dir_rank32):
    bundle = AdapterBundle.from_dir(peft_dir_rank32, name="big-rank", version=1)
    with pytest.raises(RemoteError) as ei:
        publish(agent, bundle)
    assert ei.value.status == 422 and ei.value.code == "adapter_invalid"
    assert "rank" in ei.value.message
    snap = snapshot(agent.spec.data_dir)
    assert snap["files"] == {} and snap["staging_bytes"] == 0


def test_load_rank_check_with_override(agent_factory, peft_dir):
    """--max-lora-rank lowers the limit: a staged r=8 adapter is refused at load, not loaded."""
    a = agent_factory("--max-lora-rank", "4")
    bundle = AdapterBundle.from_dir(peft_dir, name="lowrank", version=1)
    with pytest.raises(RemoteError) as ei:
        publish(a, bundle)
    assert ei.value.code == "adapter_invalid"


def test_operations_on_one_name_are_serialized(agent, peft_dir, peft_dir2):
    b1 = AdapterBundle.from_dir(peft_dir, name="ser", version=1)
    b2 = AdapterBundle.from_dir(peft_dir2, name="ser", version=2)
    publish(agent, b1, load=False)
    publish(agent, b2, load=False)

    async def go():
        async with AsyncAgentClient(agent.url, agent.spec.token) as c:
            recs = await asyncio.gather(c.load("ser", 1), c.load("ser", 2), c.load("ser", 1))
            acts = await asyncio.gather(c.activate("ser", 1), c.activate("ser", 2))
            listed = await c.list_adapters()
            # A publication's activation landing after the next one's (each retires after its
            # flip) leaves the newer version active.
            late = await c.activate("ser", 1)
            after = await c.list_adapters()
            for v in (1, 2):
                await c.unload("ser", v)
            return recs, acts, listed, late, after

    recs, _acts, listed, late, after = asyncio.run(go())
    assert {r.state.value for r in recs} == {"loaded"}
    # exactly one active version, the newer one, whichever activate ran last
    assert {r.version: r.state.value for r in listed} == {1: "loaded", 2: "active"}
    assert (late.version, late.state.value) == (1, "loaded")
    assert {r.version: r.state.value for r in after} == {1: "loaded", 2: "active"}


def test_in_place_mode(agent, engine, peft_dir, peft_dir2):
    _kind, eng = engine
    b1 = AdapterBundle.from_dir(peft_dir, name="inplace", version=1)
    b2 = AdapterBundle.from_dir(peft_dir2, name="inplace", version=2)
    _, r1 = publish(agent, b1, mode="in_place")
    assert r1.engine_name == "inplace"
    out1 = completion(eng.url, "inplace")
    _, r2 = publish(agent, b2, mode="in_place")
    assert r2.state == "loaded" and r2.engine_name == "inplace"
    assert completion(eng.url, "inplace") != out1
    listed = {r.version: r.state.value for r in call(agent, lambda c: c.list_adapters())}
    assert listed == {1: "staged", 2: "loaded"}
    call(agent, lambda c: c.unload("inplace", 1))  # files only: v2 holds the engine name
    assert completion(eng.url, "inplace") != out1
    call(agent, lambda c: c.unload("inplace", 2))
    with pytest.raises(httpx.HTTPStatusError):
        httpx.post(
            f"{eng.url}/v1/completions", json={"model": "inplace", "prompt": "x", "max_tokens": 1}
        ).raise_for_status()


def test_info_health_metrics_openapi_are_open(agent):
    r = httpx.get(agent.url + "/v1/info")
    assert r.status_code == 200 and r.json()["ready"] is True
    assert r.json()["base_model"] == "tiny"
    assert httpx.get(agent.url + "/health").json()["status"] == "ok"
    m = httpx.get(agent.url + "/metrics").text
    assert "lorafleet_agent_upload_bytes_total" in m
    spec = httpx.get(agent.url + "/openapi.json").json()
    put = spec["paths"]["/v1/uploads/{upload_id}/files/{path}"]["put"]
    names = {p["name"] for p in put["parameters"]}
    assert {"Upload-Offset", "Repr-Digest", "Content-Digest"} <= names
    assert "application/octet-stream" in put["requestBody"]["content"]


def test_reopening_the_same_manifest_returns_its_session(agent, peft_dir, peft_dir2):
    """A publisher that lost the answer to its open gets the same session back; another bundle
    for the same name is still refused while it is open."""
    from lorafleet.errors import RemoteError

    bundle = AdapterBundle.from_dir(peft_dir, name="reopen", version=1)
    other = AdapterBundle.from_dir(peft_dir2, name="reopen", version=1)

    async def go(c):
        first = await c.open_upload(bundle.manifest)
        entry = bundle.manifest.file("adapter_config.json")
        await c.upload_file(first.upload_id, entry, _source(bundle, entry.path))
        again = await c.open_upload(bundle.manifest)
        try:
            await c.open_upload(other.manifest)
            refused = None
        except RemoteError as exc:
            refused = exc
        await c.discard(again.upload_id)
        return first, again, refused

    first, again, refused = call(agent, go)
    assert again.upload_id == first.upload_id
    assert again.present == ["adapter_config.json"]
    assert again.missing == ["adapter_model.safetensors"]
    assert refused is not None and refused.status == 409
    assert refused.code == "publish_in_progress"
    assert snapshot(agent.spec.data_dir)["staging_bytes"] == 0
