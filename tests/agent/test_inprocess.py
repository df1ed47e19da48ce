"""In-process regressions: AdapterService/UploadManager/Reconciler against a fake engine.

Races and failure timings that real processes cannot hit on demand; fast (no engine, no model).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from pathlib import Path

import httpx
import pytest

import lorafleet.agent._pipe as pipe_mod
import lorafleet.agent.adapters as adapters_mod
from lorafleet.agent.backends import (
    AdapterMissing,
    EngineRejected,
    EngineUnavailable,
    VLLMBackend,
)
from lorafleet.agent.metrics import Metrics
from lorafleet.agent.state import StateDB
from lorafleet.agent.store import Store
from lorafleet.agent.uploads import UploadLimits, UploadManager
from lorafleet.errors import ServiceError
from lorafleet.protocol.agent import AdapterState, EngineCapabilities
from lorafleet.protocol.manifest import FileEntry, Manifest
from lorafleet.testing import wait_until_async

CFG = b'{"r": 8}'


class FakeEngine:
    """vLLM-like: a name loads once (400 on a second plain load); can time out after loading."""

    def __init__(self) -> None:
        self.held: dict[str, str] = {}
        self.timeout_after_load = False
        self.down = False
        self.refuse: str | None = None

    async def list_adapters(self) -> dict[str, str]:
        if self.down:
            raise EngineUnavailable("down")
        return dict(self.held)

    async def load(self, name: str, path: str, *, replace: bool = False) -> None:
        if self.down:
            raise EngineUnavailable("down")
        if self.refuse:
            raise EngineRejected(self.refuse, 500)
        if name in self.held and not replace:
            raise EngineRejected(f"The lora adapter '{name}' has already been loaded.", 400)
        self.held[name] = path
        if self.timeout_after_load:
            raise EngineUnavailable("ReadTimeout")

    async def unload(self, name: str) -> None:
        if self.down:
            raise EngineUnavailable("down")
        if name not in self.held:
            raise AdapterMissing(name)
        del self.held[name]


class _Valid:
    ok = True
    problems: list[str] = []


class Node:
    def __init__(self, root: Path, **limits) -> None:
        self.store = Store(root)
        self.metrics = Metrics()
        self.uploads = UploadManager(self.store, UploadLimits(**limits), self.metrics)
        self.engine = FakeEngine()
        self.db = StateDB(root / "state.db")
        self.svc = adapters_mod.AdapterService(
            self.store,
            self.db,
            self.uploads,
            self.engine,  # type: ignore[arg-type]
            EngineCapabilities(kind="vllm"),
            self.metrics,
        )

    async def put(self, sid: str, path: str, data: bytes, offset: int = 0, step: int = 16):
        return await self.uploads.put(
            sid,
            path,
            chunks(data, step),
            offset=offset,
            content_length=None,
            repr_digest=None,
            content_digest=None,
        )

    async def publish(self, files: dict[str, bytes], name: str = "foo", version: int = 1):
        s = self.uploads.open(manifest(name, version, files), self.svc.check_version)
        for p in s.missing:
            await self.put(s.upload_id, p, files[p])
        return await self.svc.commit(s.upload_id)

    def blobs(self) -> set[str]:
        return {p.name for p in self.store.blobs.iterdir()}


def manifest(name: str, version: int, files: dict[str, bytes]) -> Manifest:
    return Manifest(
        name=name,
        version=version,
        config={"r": 8},
        files=tuple(
            FileEntry(path=p, size=len(b), sha256=hashlib.sha256(b).hexdigest())
            for p, b in files.items()
        ),
    )


async def chunks(data: bytes, step: int = 16):
    for i in range(0, len(data), step):
        yield data[i : i + step]


@pytest.fixture
def node(tmp_path, monkeypatch) -> Node:
    monkeypatch.setattr(adapters_mod, "validate_adapter_dir", lambda *a, **k: _Valid())
    n = Node(tmp_path / "data")
    yield n
    n.db.close()


def run(coro):
    return asyncio.run(coro)


# --- unload never deletes files the engine may hold (promise 6) -----------------------------------


def test_unload_after_ambiguous_load_unloads_engine_first(node):
    files = {"adapter_config.json": CFG, "adapter_model.safetensors": b"W1" * 50}

    async def go():
        rec = await node.publish(files)
        node.engine.timeout_after_load = True  # the engine loads it, the answer is lost
        with pytest.raises(ServiceError) as ei:
            await node.svc.load("foo", 1, "versioned")
        assert ei.value.code == "engine_unavailable"
        assert "foo@v1" in node.engine.held
        # unreachable engine: refuse, keep the files
        node.engine.down = True
        with pytest.raises(ServiceError) as ei:
            await node.svc.unload("foo", 1)
        assert ei.value.code == "engine_unavailable"
        assert Path(rec.path).is_dir() and node.db.get("foo", 1) is not None
        node.engine.down = False
        await node.svc.unload("foo", 1)
        assert node.engine.held == {}
        assert not Path(rec.path).exists()

    run(go())


def test_unload_of_failed_duplicate_load_unloads_engine_first(node):
    files = {"adapter_config.json": CFG, "adapter_model.safetensors": b"W1" * 50}

    async def go():
        rec = await node.publish(files)
        node.engine.held["foo@v1"] = rec.path  # a lost answer: the engine has it already
        node.engine.refuse = "bad rank"
        with pytest.raises(ServiceError):
            await node.svc.load("foo", 1, "versioned")
        assert node.db.get("foo", 1).record.state == AdapterState.FAILED
        node.engine.refuse = None
        await node.svc.unload("foo", 1)
        assert node.engine.held == {} and not Path(rec.path).exists()

    run(go())


def test_unload_never_loaded_needs_no_engine(node):
    files = {"adapter_config.json": CFG, "adapter_model.safetensors": b"W1" * 50}

    async def go():
        rec = await node.publish(files)
        node.engine.down = True
        await node.svc.unload("foo", 1)  # the Publisher's rollback works with the engine down
        assert not Path(rec.path).exists()

    run(go())


def test_vllm_duplicate_load_of_same_path_is_success():
    loaded: dict[str, str] = {"foo@v1": "/data/adapters/foo/1"}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            cards = [{"id": "base"}] + [
                {"id": n, "parent": "base", "root": p} for n, p in loaded.items()
            ]
            return httpx.Response(200, json={"data": cards})
        return httpx.Response(
            400,
            json={"error": {"message": "The lora adapter 'foo@v1' has already been loaded."}},
        )

    async def go():
        b = VLLMBackend("http://engine")
        await b.http.aclose()
        b.http = httpx.AsyncClient(base_url=b.url, transport=httpx.MockTransport(handler))
        await b.load("foo@v1", "/data/adapters/foo/1")  # same name and path: done
        with pytest.raises(EngineRejected):
            await b.load("foo@v1", "/elsewhere")
        await b.aclose()

    run(go())


# --- the engine probe survives a garbled answer ---------------------------------------------------


def test_probe_retries_after_non_json_answer(tmp_path):
    from lorafleet.agent.config import AgentConfig
    from lorafleet.agent.runtime import Runtime

    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] <= 2:
            return httpx.Response(200, text="<html>starting</html>")
        if request.url.path == "/v1/engine_info":
            return httpx.Response(200, json={"model": "tiny", "max_loras": 4})
        return httpx.Response(200, json={"data": [{"id": "tiny"}]})

    async def go():
        cfg = AgentConfig(
            engine="reference",
            engine_url="http://engine",
            data_dir=str(tmp_path / "d"),
            token=None,
            replica_id="r0",
            reconcile_interval=0.05,
        )
        rt = Runtime(cfg)
        await rt.backend.http.aclose()
        rt.backend.http = httpx.AsyncClient(
            base_url=rt.backend.url, transport=httpx.MockTransport(handler)
        )

        await rt.start()
        try:
            await wait_until_async(lambda: rt.probed, timeout=5, message="the engine probed")
            assert rt.probed and rt.base_model == "tiny"
        finally:
            await rt.stop()

    run(go())


# --- a PUT's descriptor, cancellation and write failures ------------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _loop_turns(n: int = 5) -> None:
    """Let already-scheduled callbacks (a delivered cancellation) run: loop turns, not time."""
    for _ in range(n):
        await asyncio.sleep(0)


async def _threads_gone(prefix: str, timeout: float = 10.0) -> None:
    """Wait until no thread named ``prefix...`` runs: an executor drained its queued work."""
    await wait_until_async(
        lambda: not any(t.name.startswith(prefix) for t in threading.enumerate()),
        timeout=timeout,
        message=f"no {prefix} threads running",
    )


def test_cancelled_put_reraises_and_never_writes_into_a_reused_fd(node, monkeypatch, tmp_path):
    monkeypatch.setattr(pipe_mod, "BATCH", 16)
    real = pipe_mod._write_plain
    writing, release = threading.Event(), threading.Event()

    def held(fd, view, pos):  # every write waits until the test has reused a descriptor
        writing.set()
        release.wait(10)
        return real(fd, view, pos)

    monkeypatch.setattr(pipe_mod, "_write_plain", held)
    data = b"Z" * 160
    files = {"adapter_config.json": CFG, "adapter_model.safetensors": data}

    async def dropping():
        for i in range(0, 48, 16):
            yield data[i : i + 16]
        raise ConnectionResetError("client went away")

    async def go():
        before = _open_fds()
        s = node.uploads.open(manifest("a", 1, files), node.svc.check_version)
        t = asyncio.create_task(
            node.uploads.put(
                s.upload_id,
                "adapter_model.safetensors",
                dropping(),
                offset=0,
                content_length=None,
                repr_digest=None,
                content_digest=None,
            )
        )
        # The PUT has queued its batches and waits for them; the first one is being written.
        assert await asyncio.to_thread(writing.wait, 10)
        node.uploads.close(s.upload_id, keep_blobs=False)  # DELETE or the reaper
        await _loop_turns()  # the cancellation reaches the PUT
        other = tmp_path / "other"
        fd2 = os.open(other, os.O_WRONLY | os.O_CREAT, 0o600)  # another PUT's partial
        try:
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await t
            assert t.cancelled()
            await _threads_gone("upload-write")  # every queued write has run
        finally:
            os.close(fd2)
        assert other.read_bytes() == b""
        assert _open_fds() == before
        assert not (node.store.staging / s.upload_id).exists()

    run(go())


def test_failed_write_never_yields_a_wrong_blob(node, monkeypatch):
    monkeypatch.setattr(pipe_mod, "BATCH", 16)
    real = pipe_mod._write_plain
    calls = {"n": 0}

    def flaky(fd, view, pos):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(fd, view, pos)

    data = bytes(range(160))
    files = {"adapter_config.json": CFG, "adapter_model.safetensors": data}
    path = "adapter_model.safetensors"

    async def cut(n):
        async for c in chunks(data[:n]):
            yield c
        raise ConnectionResetError("client gone")

    async def go():
        s = node.uploads.open(manifest("bar", 1, files), node.svc.check_version)
        await node.put(s.upload_id, "adapter_config.json", CFG)
        monkeypatch.setattr(pipe_mod, "_write_plain", flaky)
        with pytest.raises((ServiceError, OSError)):
            await node.uploads.put(
                s.upload_id,
                path,
                cut(96),
                offset=0,
                content_length=None,
                repr_digest=None,
                content_digest=None,
            )
        monkeypatch.setattr(pipe_mod, "_write_plain", real)
        off = node.uploads.offset(s.upload_id, path)
        partial = node.store.partial_path(s.upload_id, path)
        assert partial.read_bytes() == data[:off]
        r = await node.put(s.upload_id, path, data[off:], offset=off)
        assert r.complete
        blob = node.store.blob_path(hashlib.sha256(data).hexdigest())
        assert blob.read_bytes() == data

    run(go())


# --- no orphaned blobs, no blob collected under a commit ------------------------------------------


def test_discarded_session_collects_blobs_it_found_present(node):
    f1 = {"adapter_config.json": CFG, "adapter_model.safetensors": b"W1" * 50}
    f2 = {"adapter_config.json": CFG, "adapter_model.safetensors": b"W2" * 50}

    async def go():
        await node.publish(f1)
        s = node.uploads.open(manifest("foo", 2, f2), node.svc.check_version)
        assert s.present == ["adapter_config.json"]
        await node.svc.unload("foo", 1)
        assert node.blobs() == {hashlib.sha256(CFG).hexdigest()}  # kept for the session
        node.uploads.close(s.upload_id, keep_blobs=False)  # discard or reap
        assert node.blobs() == set()

    run(go())


def _held_assemble(node: Node, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Make ``store.assemble`` signal ``entered`` and wait for ``release`` before it runs."""
    real = node.store.assemble
    entered, release = threading.Event(), threading.Event()

    def held(*a, **k):
        entered.set()
        release.wait(10)
        return real(*a, **k)

    monkeypatch.setattr(node.store, "assemble", held)
    return entered, release


def test_discard_during_commit_keeps_the_committing_blobs(node, monkeypatch):
    fa = {"adapter_config.json": CFG, "adapter_model.safetensors": b"A" * 64}
    fb = {"adapter_config.json": CFG, "adapter_model.safetensors": b"B" * 64}
    entered, release = _held_assemble(node, monkeypatch)

    async def go():
        sa = node.uploads.open(manifest("a", 1, fa), node.svc.check_version)
        await node.put(sa.upload_id, "adapter_config.json", CFG)
        sb = node.uploads.open(manifest("b", 1, fb), node.svc.check_version)
        assert sb.present == ["adapter_config.json"]
        await node.put(sb.upload_id, "adapter_model.safetensors", fb["adapter_model.safetensors"])
        t = asyncio.create_task(node.svc.commit(sb.upload_id))
        assert await asyncio.to_thread(entered.wait, 10)  # b's commit is assembling
        node.uploads.close(sa.upload_id, keep_blobs=False)  # a's discard meanwhile
        release.set()
        rec = await t
        assert (Path(rec.path) / "adapter_config.json").read_bytes() == CFG

    run(go())


def test_register_pins_blobs_it_found_present(node, monkeypatch, tmp_path):
    files = {"adapter_config.json": CFG, "adapter_model.safetensors": b"R" * 64}
    src = tmp_path / "shared" / "r"
    src.mkdir(parents=True)
    for p, b in files.items():
        (src / p).write_bytes(b)
    node.svc.allow = [(tmp_path / "shared").resolve()]

    async def go():
        await node.publish(files, name="old")  # the blobs are present, linked by old v1 only
        entered, release = _held_assemble(node, monkeypatch)
        t = asyncio.create_task(node.svc.register(manifest("new", 1, files), str(src)))
        assert await asyncio.to_thread(entered.wait, 10)  # new's register is assembling
        await node.svc.unload("old", 1)
        release.set()
        rec = await t
        assert (Path(rec.path) / "adapter_model.safetensors").read_bytes() == b"R" * 64

    run(go())


def test_startup_sweeps_orphans(tmp_path):
    from lorafleet.agent.config import AgentConfig
    from lorafleet.agent.runtime import Runtime

    data = tmp_path / "d"
    store = Store(data)
    db = StateDB(data / "state.db")
    blob_kept = store.blob_path("a" * 64)
    blob_kept.write_bytes(b"kept")
    kept = store.adapter_dir("keep", 1)
    kept.mkdir(parents=True)
    os.link(blob_kept, kept / "adapter_model.safetensors")
    m = manifest("keep", 1, {"adapter_config.json": CFG})
    from lorafleet.agent.state import StoredAdapter
    from lorafleet.protocol.agent import AdapterRecord

    rec = AdapterRecord(
        name="keep",
        version=1,
        digest=m.digest,
        engine_name="keep@v1",
        mode="versioned",
        state=AdapterState.STAGED,
        path=str(kept),
    )
    db.put(StoredAdapter(rec, m))
    db.close()
    store.blob_path("b" * 64).write_bytes(b"orphan")
    (store.adapters / "keep" / ".2.tmp-1234abcd").mkdir()
    orphan_dir = store.adapter_dir("gone", 3)
    orphan_dir.mkdir(parents=True)
    store.blob_path("c" * 64).write_bytes(b"linked by the orphan dir")
    os.link(store.blob_path("c" * 64), orphan_dir / "adapter_model.safetensors")

    cfg = AgentConfig(
        engine="reference",
        engine_url="http://127.0.0.1:9",
        data_dir=str(data),
        token=None,
        replica_id="r0",
    )
    rt = Runtime(cfg)
    rt.db.close()
    assert {p.name for p in store.blobs.iterdir()} == {"a" * 64}
    assert sorted(p.name for p in (store.adapters / "keep").iterdir()) == ["1"]
    assert not (store.adapters / "gone").exists()


def test_unexpected_error_is_an_enveloped_500(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from lorafleet.agent.app import AgentConfig, create_app

    cfg = AgentConfig(
        engine="reference",
        engine_url="http://127.0.0.1:9",
        data_dir=str(tmp_path / "d"),
        token=None,
        replica_id="r0",
    )
    app = create_app(cfg)
    rt = app.state.runtime

    def boom():
        raise RuntimeError("boom")

    monkeypatch.setattr(rt.service, "list", boom)
    client = TestClient(app, raise_server_exceptions=False)
    r = client.get("/v1/adapters")
    assert r.status_code == 500
    assert r.headers["x-lorafleet-error-code"] == "internal_error"
    assert r.json()["error"]["code"] == "internal_error"
    rt.db.close()


# --- a refused reinstall keeps the desired state and the agent not ready --------------------------


def test_reconciler_keeps_desired_state_and_retries(node):
    from lorafleet.agent.reconcile import Reconciler

    files = {"adapter_config.json": CFG, "adapter_model.safetensors": b"W1" * 50}
    loads = {"n": 0}
    real_load = node.engine.load

    async def counting_load(name, path, *, replace=False):
        loads["n"] += 1
        return await real_load(name, path, replace=replace)

    async def go():
        await node.publish(files)
        await node.svc.load("foo", 1, "versioned")
        await node.svc.activate("foo", 1)
        node.engine.held.clear()  # the engine restarted
        node.engine.refuse = "out of memory"  # and refuses the reinstall for a while
        node.engine.load = counting_load
        rec = Reconciler(node.svc, interval=0.01)
        await rec.run_once()
        r = node.db.get("foo", 1).record
        assert r.state == AdapterState.ACTIVE and "out of memory" in (r.error or "")
        assert not rec.ready and "out of memory" in (rec.detail or "")
        await rec.run_once()  # backing off: no second load right away
        assert loads["n"] == 1 and not rec.ready
        node.engine.refuse = None

        async def reinstalled() -> bool:
            await rec.run_once()
            return rec.ready

        # once the back-off has passed, the reinstall succeeds
        await wait_until_async(reinstalled, timeout=10, message="reinstalled after the back-off")
        assert rec.ready and "foo@v1" in node.engine.held
        r = node.db.get("foo", 1).record
        assert r.state == AdapterState.ACTIVE and r.error is None

    run(go())


# --- no walk of the blob store per request --------------------------------------------------------


def test_blob_bytes_is_counted_not_walked(tmp_path, monkeypatch):
    import lorafleet.agent.store as store_mod

    monkeypatch.setattr(adapters_mod, "validate_adapter_dir", lambda *a, **k: _Valid())
    node = Node(tmp_path / "data", quota_bytes=1 << 20)
    walks = {"n": 0}
    real = store_mod._tree_bytes

    def counting(root):
        if root == node.store.blobs:
            walks["n"] += 1
        return real(root)

    monkeypatch.setattr(store_mod, "_tree_bytes", counting)

    def actual() -> int:
        return sum(p.stat().st_size for p in node.store.blobs.iterdir())

    async def go():
        for v in range(1, 4):
            files = {"adapter_config.json": CFG, "adapter_model.safetensors": bytes([v]) * 100}
            await node.publish(files, version=v)
            assert node.store.blob_bytes() == actual()
        await node.svc.unload("foo", 1)
        s = node.uploads.open(
            manifest("foo", 9, {"adapter_config.json": CFG, "adapter_model.bin": b"n" * 10}),
            node.svc.check_version,
        )
        node.uploads.close(s.upload_id, keep_blobs=False)
        assert node.store.blob_bytes() == actual()

    run(go())
    assert walks["n"] <= 1
    node.db.close()
