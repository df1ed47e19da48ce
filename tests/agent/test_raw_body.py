"""The raw receive path (``agent._body``) over real sockets, on both event loops.

The agent's app runs under uvicorn with ``UploadHttpProtocol`` in a thread; PUTs are written
by hand onto a socket so that reads split the body anywhere: across the ring's buffers, inside a
block, between the headers and the first byte. Buffers are shrunk to a few blocks so a small
file crosses many of them.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

import lorafleet.agent._body as body_mod
import lorafleet.agent._pipe as pipe_mod
from lorafleet.agent._body import UploadHttpProtocol
from lorafleet.agent.app import AgentConfig, create_app
from lorafleet.agent.limits import UploadLimits
from lorafleet.protocol.agent import REPR_DIGEST_HEADER, UPLOAD_OFFSET_HEADER, repr_digest
from tests.agent.test_inprocess import CFG, manifest

PATH = "adapter_model.safetensors"
DATA = os.urandom(5 * 8192 + 1234)  # across five 8 KiB buffers, not a whole number of blocks
TOKEN = "raw-body-test-token"


class Agent:
    """An agent app served by uvicorn in a thread, on an ephemeral port."""

    def __init__(self, root: Path, loop: str, **limits) -> None:
        cfg = AgentConfig(
            engine="vllm",
            engine_url="http://127.0.0.1:9",
            data_dir=str(root),
            token=TOKEN,
            replica_id="raw",
            limits=UploadLimits(**limits),
        )
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(create_app(cfg), http=UploadHttpProtocol, loop=loop, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, args=([self.sock],), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the agent did not start"
            time.sleep(0.02)
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"})

    def close(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()

    def open(self, files: dict[str, bytes], version: int = 1) -> str:
        m = manifest("raw", version, files)
        r = self.http.post("/v1/uploads", json={"manifest": m.model_dump(mode="json")})
        assert r.status_code == 201, r.text
        return r.json()["upload_id"]

    def offset(self, sid: str, path: str = PATH) -> int:
        r = self.http.head(f"/v1/uploads/{sid}/files/{path}")
        assert r.status_code == 200
        return int(r.headers[UPLOAD_OFFSET_HEADER])

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port))


def head(sid: str, data_len: int, offset: int = 0, path: str = PATH, extra: str = "") -> bytes:
    return (
        f"PUT /v1/uploads/{sid}/files/{path} HTTP/1.1\r\nHost: agent\r\n"
        f"Authorization: Bearer {TOKEN}\r\nContent-Length: {data_len}\r\n"
        f"{UPLOAD_OFFSET_HEADER}: {offset}\r\nContent-Type: application/octet-stream\r\n"
        f"{extra}\r\n"
    ).encode()


def answer(s: socket.socket) -> tuple[int, bytes]:
    """One HTTP/1.1 answer with a Content-Length: (status, body)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        got = s.recv(65536)
        assert got, f"connection closed before an answer: {buf!r}"
        buf += got
    top, _, rest = buf.partition(b"\r\n\r\n")
    lines = top.split(b"\r\n")
    n = next(
        int(v) for k, _, v in (x.partition(b": ") for x in lines) if k.lower() == b"content-length"
    )
    while len(rest) < n:
        rest += s.recv(65536)
    return int(lines[0].split()[1]), rest[:n]


def ragged(data: bytes) -> Iterator[bytes]:
    """``data`` in uneven pieces: a byte, a block less one, more than a buffer, and so on."""
    sizes = [1, 4095, 9000, 8192, 333, 20_000, 7]
    i = k = 0
    while i < len(data):
        n = sizes[k % len(sizes)]
        yield data[i : i + n]
        i, k = i + n, k + 1


@pytest.fixture(params=["uvloop", "asyncio"])
def agent(request, tmp_path, monkeypatch):
    monkeypatch.setattr(pipe_mod, "BATCH", 8192)
    a = Agent(tmp_path / "data", request.param, direct_io_min_bytes=1 << 12)
    yield a
    a.close()


@pytest.fixture
def raw_reads(monkeypatch):
    """How many PUTs took the raw path."""
    seen = []
    real = body_mod.RawBody.read_into

    async def spy(self, *a, **k):
        seen.append(self.length)
        return await real(self, *a, **k)

    monkeypatch.setattr(body_mod.RawBody, "read_into", spy)
    return seen


def send_ragged(s: socket.socket, data: bytes) -> None:
    for piece in ragged(data):
        s.sendall(piece)
        time.sleep(0.0005)  # separate reads: boundaries land anywhere in the buffers


def blob(agent: Agent, data: bytes) -> Path:
    root = Path(agent.server.config.app.state.runtime.uploads.store.root)  # type: ignore[attr-defined]
    return root / "blobs" / "sha256" / hashlib.sha256(data).hexdigest()


def test_ragged_reads_across_buffers_land_exact_and_the_connection_stays_usable(agent, raw_reads):
    sid = agent.open({"adapter_config.json": CFG, PATH: DATA})
    with agent.connect() as s:
        s.sendall(head(sid, len(DATA)) + DATA[:3])  # some body arrives with the headers
        send_ragged(s, DATA[3:])
        status, body = answer(s)
        assert status == 200, body
        # The same connection, back to HTTP: another PUT, headers and body in one write.
        s.sendall(head(sid, len(CFG), path="adapter_config.json") + CFG)
        status, body = answer(s)
        assert status == 200, body
    assert raw_reads == [len(DATA), len(CFG)]
    assert blob(agent, DATA).read_bytes() == DATA


def test_a_digest_mismatch_at_the_last_byte_leaves_nothing(agent, raw_reads):
    sid = agent.open({"adapter_config.json": CFG, PATH: DATA})
    bad = DATA[:-1] + bytes([DATA[-1] ^ 1])
    with agent.connect() as s:
        s.sendall(head(sid, len(bad)))
        send_ragged(s, bad)
        status, body = answer(s)
    assert status == 422 and b"digest_mismatch" in body, body
    assert agent.offset(sid) == 0
    staging = Path(agent.server.config.app.state.runtime.uploads.store.staging)  # type: ignore[attr-defined]
    assert not any(p.is_file() for p in staging.rglob("*"))
    assert raw_reads == [len(bad)]


@pytest.mark.parametrize("cut", [1, 4095, 8192 * 2 + 777])
def test_a_cut_put_resumes_from_an_odd_offset(agent, raw_reads, cut):
    sid = agent.open({"adapter_config.json": CFG, PATH: DATA})
    s = agent.connect()
    s.sendall(head(sid, len(DATA)) + DATA[:cut])
    time.sleep(0.2)
    s.close()
    deadline = time.monotonic() + 10
    while agent.offset(sid) != cut:  # the durable prefix: every byte that arrived
        assert time.monotonic() < deadline, agent.offset(sid)
        time.sleep(0.05)
    rest = DATA[cut:]
    with agent.connect() as s:
        s.sendall(
            head(
                sid,
                len(rest),
                offset=cut,
                extra=f"{REPR_DIGEST_HEADER}: {repr_digest(hashlib.sha256(DATA).hexdigest())}\r\n",
            )
        )
        send_ragged(s, rest)
        status, body = answer(s)
    assert status == 200, body
    assert blob(agent, DATA).read_bytes() == DATA
    assert raw_reads == [len(DATA), len(rest)]


def test_expect_100_continue_gets_its_interim_answer(agent, raw_reads):
    sid = agent.open({"adapter_config.json": CFG, PATH: DATA})
    with agent.connect() as s:
        s.sendall(head(sid, len(DATA), extra="Expect: 100-continue\r\n"))
        assert s.recv(100).startswith(b"HTTP/1.1 100 Continue")
        send_ragged(s, DATA)
        status, body = answer(s)
    assert status == 200, body
    assert blob(agent, DATA).read_bytes() == DATA


def test_a_refused_put_before_the_body_never_switches(agent, raw_reads):
    sid = agent.open({"adapter_config.json": CFG, PATH: DATA})
    with agent.connect() as s:
        s.sendall(head(sid, len(DATA), offset=5) + DATA[:100])  # not the durable offset
        status, _ = answer(s)
    assert status == 409
    assert raw_reads == []


def test_httpx_upload_takes_the_raw_path(agent, raw_reads):
    async def go():
        from lorafleet.clients.agent import AsyncAgentClient
        from lorafleet.protocol.manifest import FileEntry

        entry = FileEntry(path=PATH, size=len(DATA), sha256=hashlib.sha256(DATA).hexdigest())
        async with AsyncAgentClient(agent.url, TOKEN) as c:
            sid = agent.open({"adapter_config.json": CFG, PATH: DATA})
            return await c.upload_file(sid, entry, DATA, chunk_size=5000)

    assert asyncio.run(go()).complete
    assert raw_reads == [len(DATA)]
    assert blob(agent, DATA).read_bytes() == DATA
