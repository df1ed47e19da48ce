"""``AsyncAgentClient``: the Publisher's view of one agent.

Errors: ``RemoteError`` (the agent answered with an error; ``.code`` is the protocol code) and
``TransportError`` (no answer). ``upload_file`` resumes by itself after a dropped connection:
it asks the agent for the durable offset (HEAD) and continues from there.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import BaseModel
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from lorafleet._http import REPLAYABLE, async_client, bearer, map_transport_errors, raise_for_status
from lorafleet.errors import TransportError
from lorafleet.protocol.agent import (
    REPR_DIGEST_HEADER,
    UPLOAD_OFFSET_HEADER,
    ActivateRequest,
    AdapterList,
    AdapterRecord,
    AgentInfo,
    BlobSendRequest,
    FileProgress,
    ForwardPlan,
    Health,
    LoadMode,
    LoadRequest,
    OpenUploadRequest,
    RegisterPathRequest,
    RelayAccept,
    SendRequest,
    SendResult,
    UnloadRequest,
    UploadSession,
    UploadStatus,
    VerifyRequest,
    file_url,
    repr_digest,
    upload_url,
)
from lorafleet.protocol.canary import Canary
from lorafleet.protocol.manifest import FileEntry, Manifest

__all__ = ["AsyncAgentClient"]

Source = str | os.PathLike | bytes | bytearray | memoryview
Progress = Callable[[int, int], Any]
Sent = Callable[[int], Any]


def _body(model: type[BaseModel], **fields: Any) -> dict[str, Any]:
    """``model``'s JSON body, unvalidated: the agent judges names and versions (its refusal is a
    ``RemoteError`` with the protocol's code), the model only spells the fields."""
    return model.model_construct(**fields).model_dump(mode="json")


class AsyncAgentClient:
    """Talks to one agent. Pass ``client`` to share a connection pool; ``aclose`` closes only
    a client this object created."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        *,
        client: httpx.AsyncClient | None = None,
        timeout: float | httpx.Timeout = httpx.Timeout(60.0, connect=5.0),
        max_attempts: int = 5,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = bearer(token)
        self._own = client is None
        self._http = client or async_client(timeout=timeout)
        self.timeout = timeout
        self.max_attempts = max_attempts

    async def __aenter__(self) -> AsyncAgentClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own:
            await self._http.aclose()

    async def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        url = self.base_url + path
        headers = {**self._headers, **kw.pop("headers", {})}
        with map_transport_errors(url):
            resp = await self._http.request(method, url, headers=headers, **kw)
        return raise_for_status(resp)

    # --- open endpoints --------------------------------------------------------------------

    async def info(self) -> AgentInfo:
        return AgentInfo.model_validate((await self._request("GET", "/v1/info")).json())

    async def health(self) -> Health:
        """The agent's health, ready or not (a 503 still carries a Health body)."""
        url = self.base_url + "/health"
        with map_transport_errors(url):
            resp = await self._http.get(url)
        if resp.status_code in (200, 503):
            return Health.model_validate(resp.json())
        raise_for_status(resp)
        raise AssertionError("unreachable")

    # --- uploads ---------------------------------------------------------------------------

    async def open_upload(
        self, manifest: Manifest, *, supersede: bool = False, relay: RelayAccept | None = None
    ) -> UploadSession:
        """Open (or re-open) an upload; ``supersede`` retires a failed publication's leftovers
        first (only for a publisher holding the name's lease); ``relay``: peers presenting its
        credential may send the files."""
        req = OpenUploadRequest(manifest=manifest, supersede=supersede, relay=relay)
        body = req.model_dump(mode="json")
        resp = await self._request("POST", "/v1/uploads", json=body)
        return UploadSession.model_validate(resp.json())

    async def upload_status(self, upload_id: str) -> UploadStatus:
        resp = await self._request("GET", upload_url(upload_id))
        return UploadStatus.model_validate(resp.json())

    async def set_forward(self, upload_id: str, plan: ForwardPlan) -> UploadStatus:
        """Relay: have the agent forward these files to these peers as they stream in."""
        body = plan.model_dump(mode="json")
        resp = await self._request("POST", upload_url(upload_id) + "/forward", json=body)
        return UploadStatus.model_validate(resp.json())

    async def upload_offset(self, upload_id: str, path: str) -> int:
        resp = await self._request("HEAD", file_url(upload_id, path))
        return int(resp.headers.get(UPLOAD_OFFSET_HEADER, "0"))

    async def upload_file(
        self,
        upload_id: str,
        entry: FileEntry,
        source: Source,
        *,
        chunk_size: int = 1 << 20,
        on_progress: Progress | None = None,
        on_sent: Sent | None = None,
        resume: bool = False,
    ) -> FileProgress:
        """Send one file (a path, streamed in chunks, or bytes). Resumes after a dropped
        connection from the agent's durable offset, up to ``max_attempts`` times; ``resume``:
        from the start, too. ``on_progress(offset, size)`` and ``on_sent(nbytes)`` follow each
        chunk sent (``on_sent`` counts every byte that left, resent ones included)."""
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.max_attempts),
            wait=wait_exponential(multiplier=0.1, max=2.0),
            retry=retry_if_exception_type(TransportError),
        )
        try:
            async for attempt in retrying:
                with attempt:
                    # The agent owns the offset: after a dropped connection, ask it what is
                    # durable and send only the rest (tus-style resume).
                    first = attempt.retry_state.attempt_number == 1 and not resume
                    offset = 0 if first else await self.upload_offset(upload_id, entry.path)
                    headers = {
                        UPLOAD_OFFSET_HEADER: str(offset),
                        REPR_DIGEST_HEADER: repr_digest(entry.sha256),
                        "Content-Length": str(entry.size - offset),
                        "Content-Type": "application/octet-stream",
                    }
                    body = _chunks(source, offset, entry.size, chunk_size, on_progress, on_sent)
                    resp = await self._request(
                        "PUT", file_url(upload_id, entry.path), content=body, headers=headers
                    )
                    return FileProgress.model_validate(resp.json())
        except RetryError as exc:
            raise TransportError(
                f"upload of {entry.path!r} failed after {self.max_attempts} attempts: "
                f"{exc.last_attempt.exception()}"
            ) from exc
        raise AssertionError("unreachable: tenacity either returns or raises")

    async def commit(self, upload_id: str) -> AdapterRecord:
        resp = await self._request("POST", upload_url(upload_id) + "/commit")
        return AdapterRecord.model_validate(resp.json())

    async def discard(self, upload_id: str) -> None:
        await self._request("DELETE", upload_url(upload_id))

    async def register_path(
        self, manifest: Manifest, path: str | os.PathLike, *, supersede: bool = False
    ) -> AdapterRecord:
        req = RegisterPathRequest(manifest=manifest, path=str(path), supersede=supersede)
        body = req.model_dump(mode="json")
        resp = await self._request("POST", "/v1/adapters/register", json=body)
        return AdapterRecord.model_validate(resp.json())

    # --- adapters --------------------------------------------------------------------------

    async def load(self, name: str, version: int, mode: LoadMode = "versioned") -> AdapterRecord:
        body = _body(LoadRequest, name=name, version=version, mode=mode)
        resp = await self._request("POST", "/v1/adapters/load", json=body)
        return AdapterRecord.model_validate(resp.json())

    async def verify(self, name: str, version: int, canary: Canary | None = None) -> AdapterRecord:
        """Ask the agent to check that its engine applies the loaded version (the record's
        ``application``), and answers ``canary`` as the trainer did (the record's ``canary``).
        Raises ``AdapterNotApplied`` when it answers as the base model, ``CanaryMismatch`` when
        it answers the canary otherwise."""
        body = _body(VerifyRequest, name=name, version=version, canary=canary)
        resp = await self._request("POST", "/v1/adapters/verify", json=body, extensions=REPLAYABLE)
        return AdapterRecord.model_validate(resp.json())

    async def activate(self, name: str, version: int) -> AdapterRecord:
        body = _body(ActivateRequest, name=name, version=version)
        resp = await self._request("POST", "/v1/adapters/activate", json=body)
        return AdapterRecord.model_validate(resp.json())

    async def unload(self, name: str, version: int) -> AdapterRecord:
        """Unload and delete ``name`` v``version``. ``EngineUnavailable``: the agent's engine did
        not answer; the agent keeps the version ``retiring`` and finishes when it answers."""
        body = _body(UnloadRequest, name=name, version=version)
        resp = await self._request("POST", "/v1/adapters/unload", json=body)
        return AdapterRecord.model_validate(resp.json())

    async def evict(self, name: str, version: int) -> AdapterRecord:
        """Take ``name`` v``version`` out of the engine, keeping its verified files (``staged``:
        a later ``load`` needs no bytes). ``AdapterConflict`` for a version loaded in place."""
        body = _body(UnloadRequest, name=name, version=version)
        resp = await self._request("POST", "/v1/adapters/evict", json=body)
        return AdapterRecord.model_validate(resp.json())

    async def list_adapters(self) -> list[AdapterRecord]:
        resp = await self._request("GET", "/v1/adapters")
        return AdapterList.model_validate(resp.json()).adapters

    # --- catch-up (the router feeds a lagging replica from a peer) -----------------------------

    async def manifest(self, name: str, version: int) -> Manifest:
        """The manifest of ``name`` v``version``, loaded on this agent."""
        resp = await self._request("GET", f"/v1/adapters/{quote(name, safe='')}/{version}/manifest")
        return Manifest.model_validate(resp.json())

    async def canary(self, name: str, version: int) -> Canary | None:
        """The trainer's canary ``name`` v``version`` was proven with on this agent; None when
        it was proven without one. Raises ``AdapterNotFound`` when it is not held here."""
        resp = await self._request("GET", f"/v1/adapters/{quote(name, safe='')}/{version}/canary")
        body = resp.json()
        return None if body is None else Canary.model_validate(body)

    async def send(self, req: SendRequest, timeout_s: float) -> SendResult:
        """Have this agent PUT a version it holds into a peer's relay session."""
        resp = await self._request(
            "POST",
            "/v1/adapters/send",
            json=req.model_dump(mode="json"),
            timeout=httpx.Timeout(timeout_s, connect=5.0),
        )
        return SendResult.model_validate(resp.json())

    async def send_blob(self, req: BlobSendRequest, timeout_s: float) -> SendResult:
        """Have this agent PUT one verified file it holds into a peer's relay session, from
        the peer's durable offset (a relay hop's subtree re-parented here)."""
        resp = await self._request(
            "POST",
            "/v1/blobs/send",
            json=req.model_dump(mode="json"),
            timeout=httpx.Timeout(timeout_s, connect=5.0),
        )
        return SendResult.model_validate(resp.json())


async def _chunks(
    source: Source,
    start: int,
    size: int,
    chunk_size: int,
    on_progress: Progress | None,
    on_sent: Sent | None,
) -> AsyncIterator[bytes]:
    """The bytes of ``source`` from ``start`` to ``size``, in chunks, with bounded memory."""
    sent = start
    if isinstance(source, bytes | bytearray | memoryview):
        view = memoryview(source)
        while sent < size:
            chunk = bytes(view[sent : min(size, sent + chunk_size)])
            yield chunk
            sent += len(chunk)
            if on_sent:
                on_sent(len(chunk))
            if on_progress:
                on_progress(sent, size)
        return
    f = await asyncio.to_thread(open, os.fspath(source), "rb")
    try:
        await asyncio.to_thread(f.seek, start)
        while sent < size:
            chunk = await asyncio.to_thread(f.read, min(chunk_size, size - sent))
            if not chunk:
                break
            yield chunk
            sent += len(chunk)
            if on_sent:
                on_sent(len(chunk))
            if on_progress:
                on_progress(sent, size)
    finally:
        f.close()
