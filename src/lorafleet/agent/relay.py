"""One relay hop: forward a file's bytes to peer agents while they stream in.

A ``Tee`` is fed each received chunk, in order, before the agent writes and hashes it, and
passes it to one streaming PUT per target (the targets the Publisher's ``ForwardPlan`` named,
and no other). Each target verifies its copy itself, exactly as for an upload from the
Publisher. A target that takes no byte for ``stall_s`` is dropped: it stops pacing this hop, and
its durable prefix is left for the Publisher to resume. When this agent's own copy is complete,
``finish`` waits for each target's verdict (its own targets' included, which it reports in turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence

import httpx

from lorafleet._http import bearer, error_code, error_message
from lorafleet.protocol.agent import (
    REPR_DIGEST_HEADER,
    UPLOAD_OFFSET_HEADER,
    FileProgress,
    ForwardTarget,
    RelayHop,
    file_url,
    repr_digest,
)
from lorafleet.protocol.manifest import FileEntry

__all__ = ["MAX_BUFFER", "Tee", "send_file"]

MAX_BUFFER = 8 << 20
"""Bytes queued for one target before the hop waits for it (the pipeline's slack)."""
_COALESCE = 1 << 20  # queued chunks are joined up to this size: fewer, larger socket writes


class _Forward:
    """One streaming PUT of one file to one target."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        target: ForwardTarget,
        entry: FileEntry,
        credential: str,
        stall_s: float,
    ) -> None:
        self.target = target
        self.entry = entry
        self.stall_s = stall_s
        self.queue: deque[bytes] = deque()
        self.buffered = 0
        self.data = asyncio.Event()
        self.space = asyncio.Event()
        self.space.set()
        self.ended = False
        self.hops: list[RelayHop] | None = None
        self.first_byte: float | None = None
        """When the first byte went out (``perf_counter``): a hop's ``seconds`` start there."""
        self.task = asyncio.create_task(self._run(http, credential), name="relay-forward")

    @property
    def alive(self) -> bool:
        return not self.task.done()

    def _hop(self, ok: bool, code: str | None = None, detail: str | None = None) -> RelayHop:
        t0 = self.first_byte
        return RelayHop(
            url=self.target.url,
            upload_id=self.target.upload_id,
            path=self.entry.path,
            ok=ok,
            code=code,
            detail=detail,
            seconds=None if t0 is None else time.perf_counter() - t0,
        )

    async def _body(self) -> AsyncIterator[bytes]:
        while True:
            while not self.queue:
                if self.ended:
                    return
                self.data.clear()
                await self.data.wait()
            chunk = self.queue.popleft()
            if self.queue and len(chunk) < _COALESCE:
                parts = [chunk]
                n = len(chunk)
                while self.queue and n < _COALESCE:
                    parts.append(self.queue.popleft())
                    n += len(parts[-1])
                chunk = b"".join(parts)
            self.buffered -= len(chunk)
            if self.buffered <= MAX_BUFFER:
                self.space.set()
            if self.first_byte is None:
                self.first_byte = time.perf_counter()
            yield chunk

    async def _run(self, http: httpx.AsyncClient, credential: str) -> None:
        t, entry = self.target, self.entry
        headers = {
            **bearer(credential),
            UPLOAD_OFFSET_HEADER: "0",
            REPR_DIGEST_HEADER: repr_digest(entry.sha256),
            "Content-Length": str(entry.size),
            "Content-Type": "application/octet-stream",
        }
        # write: a target that stops reading for stall_s; read: its verdict after the last byte.
        timeout = httpx.Timeout(
            connect=min(self.stall_s, 10.0), write=self.stall_s, read=t.answer_timeout_s, pool=5.0
        )
        try:
            resp = await http.put(
                t.url + file_url(t.upload_id, entry.path),
                content=self._body(),
                headers=headers,
                timeout=timeout,
            )
        except httpx.WriteTimeout:
            self.hops = [self._hop(False, "stalled", f"took no byte for {self.stall_s:g} s")]
        except httpx.TimeoutException as exc:
            self.hops = [self._hop(False, "transport", f"no verdict: {type(exc).__name__}")]
        except (httpx.HTTPError, httpx.StreamError, OSError) as exc:
            self.hops = [self._hop(False, "transport", f"{type(exc).__name__}: {exc}")]
        else:
            if resp.status_code == 200:
                prog = FileProgress.model_validate(resp.json())
                self.hops = [self._hop(prog.complete), *prog.relayed]
            else:
                self.hops = [self._hop(False, error_code(resp), error_message(resp))]
        finally:
            self.space.set()  # a feeder waiting for room must not wait for a finished PUT

    async def put(self, chunk: bytes) -> None:
        if not self.alive:
            return
        self.queue.append(chunk)
        self.buffered += len(chunk)
        self.data.set()
        if self.buffered > MAX_BUFFER:
            self.space.clear()
            try:
                async with asyncio.timeout(self.stall_s):
                    await self.space.wait()
            except TimeoutError:
                self.drop("stalled", f"took no byte for {self.stall_s:g} s")

    def end(self) -> None:
        self.ended = True
        self.data.set()

    def drop(self, code: str, detail: str) -> None:
        if self.alive:
            self.task.cancel()
            self.hops = [self._hop(False, code, detail)]
        self.queue.clear()
        self.buffered = 0

    async def verdict(self) -> list[RelayHop]:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(self.task)
        if self.task.cancelled() or self.hops is None:
            return self.hops or [self._hop(False, "aborted", "the forward was cancelled")]
        return self.hops


class Tee:
    """Forward one file to ``targets`` as it streams in (see the module docstring)."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        targets: Sequence[ForwardTarget],
        entry: FileEntry,
        credential: str,
        stall_s: float,
    ) -> None:
        self.forwards = [_Forward(http, t, entry, credential, stall_s) for t in targets]

    async def feed(self, chunk: bytes) -> None:
        """Queue ``chunk`` for every live target; waits while one is ``MAX_BUFFER`` behind."""
        for f in self.forwards:
            await f.put(chunk)

    async def finish(self) -> list[RelayHop]:
        """Every byte was fed: end each PUT and return every hop's verdict."""
        for f in self.forwards:
            f.end()
        return [h for f in self.forwards for h in await f.verdict()]

    async def abort(self, detail: str) -> list[RelayHop]:
        """This hop's own copy broke off: cut every PUT short (each target keeps its durable
        prefix) and return the hops, each failed."""
        for f in self.forwards:
            f.drop("aborted", detail)
        return [h for f in self.forwards for h in await f.verdict()]

    def close(self) -> None:
        """Cut any PUT still running short (the upstream PUT ended before ``finish``/``abort``)."""
        for f in self.forwards:
            if f.alive:
                f.drop("aborted", "the upstream PUT ended")


async def send_file(
    http: httpx.AsyncClient,
    target: ForwardTarget,
    entry: FileEntry,
    src: str,
    credential: str,
    stall_s: float,
    chunk: int = 1 << 20,
    offset: int = 0,
) -> tuple[RelayHop, int, list[RelayHop]]:
    """Catch-up: PUT one stored file to a peer's session, as a relay hop would (the same
    headers and credential; the peer verifies size and sha-256), from ``offset`` (the peer's
    durable prefix). Returns (the peer's verdict, bytes sent, the verdicts of the peers it
    forwarded the file to in turn, when its session relays)."""
    sent = 0
    first_byte: float | None = None

    async def body() -> AsyncIterator[bytes]:
        nonlocal sent, first_byte
        with open(src, "rb") as f:
            f.seek(offset)
            while data := await asyncio.to_thread(f.read, chunk):
                sent += len(data)
                if first_byte is None:
                    first_byte = time.perf_counter()
                yield data

    def hop(ok: bool, code: str | None = None, detail: str | None = None) -> RelayHop:
        return RelayHop(
            url=target.url, upload_id=target.upload_id, path=entry.path, ok=ok, code=code,
            detail=detail, seconds=None if first_byte is None else time.perf_counter() - first_byte,
        )  # fmt: skip

    headers = {
        **bearer(credential),
        UPLOAD_OFFSET_HEADER: str(offset),
        REPR_DIGEST_HEADER: repr_digest(entry.sha256),
        "Content-Length": str(entry.size - offset),
        "Content-Type": "application/octet-stream",
    }
    timeout = httpx.Timeout(
        connect=min(stall_s, 10.0), write=stall_s, read=target.answer_timeout_s, pool=5.0
    )
    try:
        resp = await http.put(
            target.url + file_url(target.upload_id, entry.path),
            content=body(),
            headers=headers,
            timeout=timeout,
        )
    except (httpx.HTTPError, httpx.StreamError, OSError) as exc:
        return hop(False, "transport", f"{type(exc).__name__}: {exc}"), sent, []
    if resp.status_code == 200:
        prog = FileProgress.model_validate(resp.json())
        return hop(prog.complete), sent, prog.relayed
    return hop(False, error_code(resp), error_message(resp)), sent, []
