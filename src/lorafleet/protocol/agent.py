"""The agent's wire protocol: routes, headers and bodies. Imported by the agent and the Publisher.

Upload flow (all under the control token)::

    POST   /v1/uploads                           OpenUploadRequest -> 201 UploadSession
    GET    /v1/uploads/{upload_id}               -> UploadStatus
    HEAD   /v1/uploads/{upload_id}/files/{path}  -> 200, header Upload-Offset (durable bytes)
    PUT    /v1/uploads/{upload_id}/files/{path}  raw bytes from Upload-Offset -> FileProgress
    POST   /v1/uploads/{upload_id}/commit        -> AdapterRecord (state "staged")
    DELETE /v1/uploads/{upload_id}               -> 204, staged bytes removed

Relay (one publication's bytes sent once and forwarded agent to agent while they stream in)::

    POST   /v1/uploads                           OpenUploadRequest with ``relay``: this session
                                                 also takes PUT/HEAD from a peer that presents the
                                                 publication's credential (its sha-256 is given)
    POST   /v1/uploads/{upload_id}/forward       ForwardPlan -> UploadStatus: while a file of this
                                                 session streams in from offset 0, tee it to the
                                                 plan's targets (and nowhere else)
    GET    /v1/uploads/{upload_id}               ``FileProgress.relayed``: each hop's outcome

Catch-up (a lagging replica fed from a peer, driven by the router; ``docs/quorum.md``)::

    GET    /v1/adapters/{name}/{version}/manifest  -> Manifest of a version this agent holds
    POST   /v1/adapters/send       SendRequest -> SendResult: PUT this version's files from the
                                   store into a peer's session opened with ``relay`` (the
                                   credential is minted for that one catch-up); the peer
                                   verifies each file's size and sha-256 as for any upload

Adapters::

    POST   /v1/adapters/register   RegisterPathRequest (shared filesystem) -> AdapterRecord
    POST   /v1/adapters/load       LoadRequest -> AdapterRecord ("loaded")
    POST   /v1/adapters/verify     VerifyRequest -> AdapterRecord (``application`` set); 502
                                   adapter_not_applied when the engine ignores the adapter, 502
                                   canary_mismatch when it answers the trainer's canary
                                   otherwise than the trainer (``protocol/canary.py``)
    POST   /v1/adapters/activate   ActivateRequest -> AdapterRecord ("active")
    POST   /v1/adapters/evict      UnloadRequest -> AdapterRecord (out of the engine, its verified
                                   files kept: staged, loadable again without bytes)
    POST   /v1/adapters/unload     UnloadRequest -> AdapterRecord (removed from engine and store);
                                   503 engine_unavailable: it stays "retiring" and the agent
                                   removes it (engine first, then files) once the engine answers
    GET    /v1/adapters            -> AdapterList
    GET    /v1/info                -> AgentInfo        (open)
    GET    /health                 -> Health, 200 ready / 503 not ready (open)
    GET    /metrics                Prometheus text (open)
"""

from __future__ import annotations

import base64
import hashlib
from enum import StrEnum
from typing import Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator

from lorafleet.errors import InvalidRequest
from lorafleet.protocol.canary import Canary, CanaryVerdict
from lorafleet.protocol.manifest import FileEntry, Manifest
from lorafleet.protocol.names import AdapterName, Version

__all__ = [
    "CONTENT_DIGEST_HEADER",
    "MAX_FANOUT",
    "REPR_DIGEST_HEADER",
    "UPLOAD_OFFSET_HEADER",
    "ActivateRequest",
    "AdapterList",
    "AdapterRecord",
    "AdapterState",
    "AgentInfo",
    "Application",
    "BlobSendRequest",
    "EngineCapabilities",
    "EngineKind",
    "FileEntry",
    "FileProgress",
    "ForwardPlan",
    "ForwardTarget",
    "Health",
    "LoadMode",
    "LoadRequest",
    "Manifest",
    "OpenUploadRequest",
    "RegisterPathRequest",
    "RelayAccept",
    "RelayHop",
    "SendRequest",
    "SendResult",
    "UnloadRequest",
    "UploadSession",
    "UploadStatus",
    "VerifyRequest",
    "check_local_path",
    "check_peer_url",
    "credential_digest",
    "engine_name",
    "file_url",
    "repr_digest",
    "upload_url",
]

UPLOAD_OFFSET_HEADER = "Upload-Offset"
# RFC 9530. Repr-Digest: the whole file's sha-256 (checked against the manifest).
# Content-Digest: the sha-256 of this request's body (checked for this chunk).
REPR_DIGEST_HEADER = "Repr-Digest"
CONTENT_DIGEST_HEADER = "Content-Digest"

LoadMode = Literal["versioned", "in_place"]
Application = Literal["unchecked", "applied", "unverifiable", "not_applied"]


def engine_name(name: str, version: int, mode: LoadMode = "versioned") -> str:
    """The engine-side adapter name: immutable ``name@vN`` per version, or the plain name."""
    return name if mode == "in_place" else f"{name}@v{version}"


def upload_url(upload_id: str) -> str:
    return f"/v1/uploads/{upload_id}"


def file_url(upload_id: str, path: str) -> str:
    return f"/v1/uploads/{upload_id}/files/{path}"


# What a local filesystem takes (Linux's NAME_MAX and PATH_MAX, in bytes).
_NAME_MAX_BYTES = 255
_PATH_MAX_BYTES = 4095


def check_local_path(path: str) -> str:
    """Return ``path`` if the filesystem can even be asked about it; raise ``InvalidRequest``.

    Refused before any system call: an empty path, a NUL byte, text that is not valid UTF-8
    (lone surrogates), a component over 255 bytes or a path over 4095 bytes.
    """
    if not path:
        raise InvalidRequest("path is empty", param="path")
    if "\x00" in path:
        raise InvalidRequest("path contains a NUL byte", param="path")
    try:
        raw = path.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("path is not valid UTF-8", param="path") from None
    if len(raw) > _PATH_MAX_BYTES:
        raise InvalidRequest(f"path is over {_PATH_MAX_BYTES} bytes", param="path")
    if any(len(part) > _NAME_MAX_BYTES for part in raw.split(b"/")):
        raise InvalidRequest(f"a component of path is over {_NAME_MAX_BYTES} bytes", param="path")
    return path


UPLOAD_ID_PATTERN = r"^[0-9a-f]{32}$"
MAX_FANOUT = 16
"""The most targets one agent forwards one file to."""


def repr_digest(sha256_hex: str) -> str:
    """An RFC 9530 ``Repr-Digest``/``Content-Digest`` value for a hex sha-256."""
    return f"sha-256=:{base64.b64encode(bytes.fromhex(sha256_hex)).decode()}:"


def credential_digest(credential: str) -> str:
    """The hex sha-256 of a relay credential: what a receiving agent is given and compares."""
    return hashlib.sha256(credential.encode()).hexdigest()


def check_peer_url(url: str) -> str:
    """``url`` as an agent's base URL (``http(s)://host[:port]``, no path, query or user);
    raise ``ValueError`` otherwise. Returned without a trailing slash."""
    try:
        u = httpx.URL(url)
    except Exception as exc:  # httpx raises more than InvalidURL for odd text; all are 400s
        raise ValueError(f"not a URL: {exc}") from None
    if u.scheme not in ("http", "https") or not u.host:
        raise ValueError("an agent URL is http(s)://host[:port]")
    if u.userinfo or u.query or u.fragment or u.path not in ("", "/"):
        raise ValueError("an agent URL has no user, path, query or fragment")
    return url.rstrip("/")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RelayAccept(_Model):
    """A session that takes relayed bytes: PUT and HEAD on its files are also allowed to a peer
    agent presenting the credential whose sha-256 this is (minted by the Publisher for one
    publication; it dies with the session, and opens nothing else)."""

    credential_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    stall_s: float = Field(10.0, gt=0, le=600)
    """A relayed PUT that receives no byte for this long is cut off (its durable prefix stays,
    for the Publisher to resume)."""


class OpenUploadRequest(_Model):
    manifest: Manifest
    supersede: bool = False
    """Remove this name's never-activated leftovers first (records of this version or newer
    from a publication that failed, e.g. while an engine was down). Only a publisher that holds
    the name's lease at the router may ask; otherwise a clash is refused (409)."""
    relay: RelayAccept | None = None


class ForwardTarget(_Model):
    """One peer's upload session that this agent forwards a file to."""

    url: str = Field(max_length=2048)
    upload_id: str = Field(pattern=UPLOAD_ID_PATTERN)
    answer_timeout_s: float = Field(gt=0, le=86400)
    """How long to wait for the peer's verdict after its last byte (its own subtree included)."""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return check_peer_url(v)


class ForwardPlan(_Model):
    """Where one session's files go on: path -> targets. Set by the Publisher (control token);
    an agent forwards to these targets only, presenting ``credential`` to them."""

    credential: str = Field(min_length=16, max_length=256, pattern=r"^[A-Za-z0-9_-]+$")
    stall_s: float = Field(10.0, gt=0, le=600)
    """A target that takes no byte for this long is dropped (and left for the Publisher)."""
    files: dict[str, list[ForwardTarget]] = Field(max_length=4096)

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, list[ForwardTarget]]) -> dict[str, list[ForwardTarget]]:
        for path, targets in v.items():
            if len(targets) > MAX_FANOUT:
                raise ValueError(f"{path!r}: at most {MAX_FANOUT} targets per file")
            if len({(t.url, t.upload_id) for t in targets}) != len(targets):
                raise ValueError(f"{path!r}: a target appears twice")
        return v


class RelayHop(_Model):
    """What became of one forwarded copy: the target agent's verdict, or why there was none."""

    url: str
    upload_id: str
    path: str
    ok: bool
    """The target verified the whole file."""
    code: str | None = None
    """Its error code (``digest_mismatch``, ...), ``transport`` (no answer) or ``stalled``."""
    detail: str | None = None
    seconds: float | None = Field(default=None, ge=0)
    """From the first byte sent to this hop until its verdict, as its sender saw it (what the
    Publisher measures a tree's per-hop time and receive rate from: ``RelayMeasure``)."""


class SendRequest(_Model):
    """Send a stored version's files to one peer's upload session (a catch-up)."""

    name: AdapterName
    version: Version
    target: ForwardTarget
    credential: str = Field(min_length=16, max_length=256, pattern=r"^[A-Za-z0-9_-]+$")
    """Presented to the target; its session was opened with this credential's sha-256."""
    paths: list[str] | None = Field(default=None, max_length=4096)
    """The files the target lacks (None: every file of the manifest)."""
    stall_s: float = Field(10.0, gt=0, le=600)


class BlobSendRequest(_Model):
    """Send one verified file this agent holds (by sha-256) into a peer's upload session, from
    ``offset`` (the peer's durable prefix): how a dead relay hop's subtree is fed by a live
    replica instead of the trainer."""

    entry: FileEntry
    target: ForwardTarget
    credential: str = Field(min_length=16, max_length=256, pattern=r"^[A-Za-z0-9_-]+$")
    """Presented to the target; its session was opened with this credential's sha-256."""
    offset: int = Field(default=0, ge=0)
    stall_s: float = Field(10.0, gt=0, le=600)


class SendResult(_Model):
    hops: list[RelayHop]
    """The target's verdict on each file sent."""
    bytes_sent: int
    relayed: list[RelayHop] = Field(default_factory=list)
    """Where the target's session relays (a catch-up tree): the verdicts of the peers it
    forwarded each file to, and theirs in turn."""


class UploadSession(_Model):
    upload_id: str
    missing: list[str]
    """Paths the agent still needs; the rest are already in its content-addressed store."""
    present: list[str]
    expires_in_s: float


class FileProgress(_Model):
    path: str
    size: int
    sha256: str
    offset: int
    """Bytes durably received (fsynced). A resumed PUT starts here."""
    complete: bool
    receiving: bool = False
    """A PUT is writing this file now."""
    error_code: str | None = None
    """Why the last PUT of this file was refused (``digest_mismatch``, ...), if it was."""
    error: str | None = None
    relayed: list[RelayHop] = Field(default_factory=list)
    """Relay: each forwarded copy's outcome, this agent's targets and theirs in turn."""


class UploadStatus(_Model):
    upload_id: str
    name: str
    version: int
    files: list[FileProgress]


class RegisterPathRequest(_Model):
    """Shared filesystem: the agent verifies ``path`` against ``manifest`` and ingests it."""

    manifest: Manifest
    path: str = Field(min_length=1, max_length=_PATH_MAX_BYTES)
    """A directory under one of the agent's ``--shared-fs-allow`` roots."""
    supersede: bool = False
    """As for ``OpenUploadRequest``."""

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        return check_local_path(v)


class LoadRequest(_Model):
    name: AdapterName
    version: Version
    mode: LoadMode = "versioned"


class VerifyRequest(_Model):
    name: AdapterName
    version: Version
    canary: Canary | None = None
    """The trainer's canary: the engine must also answer it as the trainer computed."""


class ActivateRequest(_Model):
    name: AdapterName
    version: Version


class UnloadRequest(_Model):
    name: AdapterName
    version: Version


class AdapterState(StrEnum):
    STAGED = "staged"
    LOADED = "loaded"
    ACTIVE = "active"
    FAILED = "failed"
    RETIRING = "retiring"
    """Unload requested while the engine did not answer: the agent finishes it (engine first,
    then the files) as soon as the engine answers again."""


class AdapterRecord(_Model):
    name: str
    version: int
    digest: str
    engine_name: str
    mode: LoadMode
    state: AdapterState
    path: str
    error: str | None = None
    application: Application = "unchecked"
    """Whether the engine was seen to apply it: ``applied``, ``unverifiable`` (its delta is zero
    or too small to show), ``not_applied``, or ``unchecked``."""
    delta_bound: float | None = None
    """Upper bound on the entries of its weight delta (0: it changes nothing; None: unknown)."""
    canary: CanaryVerdict | None = None
    """How the engine answered the trainer's canary at the last verify that sent one."""


class AdapterList(_Model):
    adapters: list[AdapterRecord]


EngineKind = Literal["vllm", "sglang", "reference"]
"""The engine kinds an agent can drive; each one's facts live in ``lorafleet.engine_kinds``."""


class EngineCapabilities(_Model):
    kind: EngineKind
    max_lora_rank: int | None = None
    max_adapters: int | None = None
    upsert: bool = False
    """The engine replaces an adapter in place under the same name."""
    unload_frees_slot: bool = True
    """False for vLLM: /v1/unload_lora_adapter leaves the adapter cached (vLLM #54839)."""
    max_loras_per_batch: int | None = None
    """SGLang: distinct adapters one batch may mix (its ``--max-loras-per-batch``)."""
    lora_target_modules: list[str] | None = None
    """SGLang: the modules its LoRA pool covers, as given at launch (``["all"]``: every one)."""


class AgentInfo(_Model):
    replica_id: str
    engine_url: str
    base_model: str
    capabilities: EngineCapabilities
    ready: bool


class Health(_Model):
    status: Literal["ok", "not_ready"]
    engine_reachable: bool
    reconciling: bool
    detail: str | None = None
