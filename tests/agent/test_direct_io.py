"""Large files are written with O_DIRECT from an aligned buffer: same bytes, same offsets.

Sizes and offsets are chosen off the 4 KiB grid and across the 4 MiB buffer, so every branch of
the aligned writer runs: an unaligned resume, a buffer that fills mid-chunk, a sub-block tail.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import hashlib
import os

import pytest

import lorafleet.agent._direct as direct_mod
import lorafleet.agent._pipe as pipe_mod
import lorafleet.agent.adapters as adapters_mod
from lorafleet.errors import ServiceError
from tests.agent.test_inprocess import CFG, Node, _Valid, manifest

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")

PATH = "adapter_model.safetensors"
DATA = os.urandom((9 << 20) + 1234)  # over two 4 MiB buffers, not a whole number of blocks


@pytest.fixture(autouse=True)
def _direct_io(tmp_path):
    """Skip where the temporary directory's file system refuses O_DIRECT (tmpfs before 6.6)."""
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError as exc:
        pytest.skip(f"no O_DIRECT under {tmp_path}: {exc}")
    finally:
        (tmp_path / "probe").unlink(missing_ok=True)


@pytest.fixture
def node(tmp_path, monkeypatch):
    monkeypatch.setattr(adapters_mod, "validate_adapter_dir", lambda *a, **k: _Valid())
    n = Node(tmp_path / "data", direct_io_min_bytes=1 << 20)
    yield n
    n.db.close()


@pytest.fixture
def writes(monkeypatch):
    """Bytes written per kind of descriptor: {"direct": n, "cached": n}."""
    seen = {"direct": 0, "cached": 0}
    real = os.pwrite

    def spy(fd, data, offset):
        n = real(fd, data, offset)
        kind = "direct" if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT else "cached"
        seen[kind] += n
        return n

    monkeypatch.setattr(direct_mod.os, "pwrite", spy)
    return seen


async def ragged(data: bytes, stop: int | None = None, fail: bool = False):
    """``data[:stop]`` in uneven pieces (some bigger than the buffer); then maybe a reset."""
    sizes = [1, 4095, 70_001, 5 << 20, 333, 262_144]
    i, k = 0, 0
    end = len(data) if stop is None else stop
    while i < end:
        n = min(sizes[k % len(sizes)], end - i)
        yield data[i : i + n]
        i, k = i + n, k + 1
    if fail:
        raise ConnectionResetError("client went away")


def put(node, sid, body, offset=0):
    return node.uploads.put(
        sid, PATH, body, offset=offset, content_length=None, repr_digest=None, content_digest=None
    )


def test_large_file_goes_past_the_page_cache_and_lands_exact(node, writes):
    files = {"adapter_config.json": CFG, PATH: DATA}

    async def go():
        s = node.uploads.open(manifest("a", 1, files), node.svc.check_version)
        await node.put(s.upload_id, "adapter_config.json", CFG)  # under the floor: cached
        assert writes == {"direct": 0, "cached": len(CFG)}
        r = await put(node, s.upload_id, ragged(DATA))
        assert r.complete
        blob = node.store.blob_path(hashlib.sha256(DATA).hexdigest())
        assert blob.read_bytes() == DATA

    asyncio.run(go())
    assert writes["direct"] == len(DATA) - len(DATA) % 4096
    assert writes["cached"] == len(CFG) + len(DATA) % 4096  # only the tail under a block


def test_resume_from_an_unaligned_offset(node, writes):
    files = {"adapter_config.json": CFG, PATH: DATA}
    cut = (5 << 20) + 777

    async def go():
        s = node.uploads.open(manifest("a", 1, files), node.svc.check_version)
        with pytest.raises(ConnectionResetError):
            await put(node, s.upload_id, ragged(DATA, cut, fail=True))
        off = node.uploads.offset(s.upload_id, PATH)
        assert off == cut  # everything received is durable, tail included
        assert node.store.partial_path(s.upload_id, PATH).read_bytes() == DATA[:off]
        r = await put(node, s.upload_id, ragged(DATA[off:]), offset=off)
        assert r.complete
        blob = node.store.blob_path(hashlib.sha256(DATA).hexdigest())
        assert blob.read_bytes() == DATA

    asyncio.run(go())
    # The resumed PUT reached the next block boundary through the page cache, then went direct.
    assert writes["cached"] < 3 * 4096
    assert writes["direct"] + writes["cached"] == len(DATA)


def test_a_file_system_refusing_direct_writes_falls_back(node, monkeypatch):
    real = os.pwrite
    refused = []

    def picky(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(direct_mod.os, "pwrite", picky)
    files = {"adapter_config.json": CFG, PATH: DATA}

    async def go():
        s = node.uploads.open(manifest("a", 1, files), node.svc.check_version)
        assert (await put(node, s.upload_id, ragged(DATA))).complete
        return node.store.blob_path(hashlib.sha256(DATA).hexdigest()).read_bytes()

    assert asyncio.run(go()) == DATA
    assert len(refused) == 1  # asked once, then the page cache for the rest of the file


def test_a_failed_direct_write_keeps_only_the_written_prefix(node, monkeypatch):
    real = os.pwrite
    calls = {"direct": 0}

    def full_disk(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            calls["direct"] += 1
            if calls["direct"] == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    files = {"adapter_config.json": CFG, PATH: DATA}

    async def go():
        s = node.uploads.open(manifest("a", 1, files), node.svc.check_version)
        monkeypatch.setattr(direct_mod.os, "pwrite", full_disk)
        with pytest.raises(ServiceError) as err:
            await put(node, s.upload_id, ragged(DATA))
        assert err.value.status == 500
        monkeypatch.setattr(direct_mod.os, "pwrite", real)
        off = node.uploads.offset(s.upload_id, PATH)
        assert off == pipe_mod.BATCH  # the first buffer, nothing of the one that failed
        assert node.store.partial_path(s.upload_id, PATH).read_bytes()[:off] == DATA[:off]
        r = await put(node, s.upload_id, ragged(DATA[off:]), offset=off)
        assert r.complete
        blob = node.store.blob_path(hashlib.sha256(DATA).hexdigest())
        assert blob.read_bytes() == DATA

    asyncio.run(go())


def test_small_files_stay_in_the_page_cache(tmp_path, monkeypatch, writes):
    monkeypatch.setattr(adapters_mod, "validate_adapter_dir", lambda *a, **k: _Valid())
    n = Node(tmp_path / "data")  # the default floor, 64 MiB
    files = {"adapter_config.json": CFG, PATH: DATA}

    async def go():
        s = n.uploads.open(manifest("a", 1, files), n.svc.check_version)
        assert (await put(n, s.upload_id, ragged(DATA))).complete

    try:
        asyncio.run(go())
    finally:
        n.db.close()
    assert writes == {"direct": 0, "cached": len(DATA)}  # no direct descriptor
