"""Tenants: teams sharing one fleet, each with a token scoped to its own adapter names.

A tenants file (TOML, or JSON) lists one ``[[tenant]]`` table per team::

    [[tenant]]
    id = "alice"                      # an adapter name (lorafleet.protocol.names's rule)
    token_sha256 = "<hex sha256>"     # or, for tests and development, token = "..."
    names = ["alice-*"]               # fnmatch patterns, case-sensitive; at least one
    max_adapters = 8                  # optional: distinct names in the router's table
    max_bytes = 100_000_000           # optional: bytes of its routable versions
    max_slots = 4                     # optional: replica slots its versions hold (placement)

The router's data plane, the data-plane copies and the front read the same file
(``Tenants.load``): a request whose bearer token is a tenant's may name only that tenant's
adapters (``Tenant.owns``) and the base model; everything else answers as a name that does not
exist. ``Tenant.check_quota`` judges a load against the router's table. docs/tenants.md says
which route checks what.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lorafleet.errors import InvalidRequest, TenantQuotaExceeded
from lorafleet.protocol.names import check_name
from lorafleet.protocol.router import AliasEntry

__all__ = ["OPERATOR", "Caller", "Tenant", "TenantUsage", "Tenants", "adapter_of", "token_digest"]

_HEX64 = re.compile(r"[0-9a-f]{64}")


def token_digest(token: str | bytes) -> bytes:
    """The SHA-256 digest a tenants file stores for ``token`` (``token_sha256`` is its hex)."""
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


def adapter_of(model: str) -> str:
    """The adapter name a ``model`` string names: ``policy@v7`` -> ``policy``; else itself."""
    name, at, v = model.rpartition("@v")
    return name if at and v.isdigit() else model


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """What a tenant's names hold in the router's table."""

    adapters: int
    bytes: int
    slots: int


class Tenant(BaseModel):
    """One tenant: its token (as a digest), the name patterns it owns and its quotas."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    token_sha256: str | None = Field(default=None, repr=False)
    token: str | None = Field(default=None, repr=False, min_length=1)
    """The token itself: for tests and development (a real file stores ``token_sha256``)."""
    names: tuple[str, ...] = Field(min_length=1)
    max_adapters: int | None = Field(default=None, ge=0)
    max_bytes: int | None = Field(default=None, ge=0)
    max_slots: int | None = Field(default=None, ge=0)
    """Enforced by the router's placement, not here (docs/tenants.md)."""

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        return check_name(value, param="id")

    @field_validator("token_sha256")
    @classmethod
    def _hex(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip().lower()
        if not _HEX64.fullmatch(value):
            raise InvalidRequest("token_sha256 must be 64 hex digits", param="token_sha256")
        return value

    @field_validator("names")
    @classmethod
    def _patterns(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in value:
            if not pattern or not pattern.strip():
                raise InvalidRequest("a name pattern must not be empty", param="names")
        return value

    @model_validator(mode="after")
    def _one_token(self) -> Tenant:
        if (self.token is None) == (self.token_sha256 is None):
            raise InvalidRequest(
                f"tenant {self.id!r} needs exactly one of token_sha256 and token", param="token"
            )
        return self

    @property
    def digest(self) -> bytes:
        """SHA-256 of the tenant's token: what a presented token is compared with."""
        if self.token_sha256 is not None:
            return bytes.fromhex(self.token_sha256)
        assert self.token is not None
        return token_digest(self.token)

    def owns(self, name: str) -> bool:
        """Whether adapter ``name`` is this tenant's: some pattern matches it (case-sensitive)."""
        return any(fnmatchcase(name, p) for p in self.names)

    def usage(self, aliases: Mapping[str, AliasEntry]) -> TenantUsage:
        """What this tenant's names hold in ``aliases`` (the router's table)."""
        adapters = size = slots = 0
        for name, entry in aliases.items():
            if not self.owns(name):
                continue
            adapters += 1
            for v in entry.window():
                size += v.size or 0
                slots += len(v.replicas)
        return TenantUsage(adapters, size, slots)

    def check_quota(
        self,
        aliases: Mapping[str, AliasEntry],
        name: str,
        size: int | None,
        slots: int = 0,
    ) -> TenantUsage:
        """Refuse what would take this tenant past a quota; return the usage it would have.

        ``size`` not None: a new version of ``name`` of ``size`` bytes (a load, a publication),
        held on ``slots`` replica slots. The versions the name's retention window (its entry's
        ``keep_versions``) drops when it lands are not counted, so a tenant at its byte limit
        can keep publishing versions of one size. ``size`` None: no new version, ``slots`` more
        replica slots for ``name`` (placement loading a version on one more replica).

        ``max_slots`` is judged only when ``slots`` is given. Raises ``TenantQuotaExceeded``
        (409), naming the quota, the limit and the usage.
        """
        now = self.usage(aliases)
        adapters, total, held = now.adapters, now.bytes, now.slots + slots
        entry = aliases.get(name)
        if entry is None:
            adapters += 1
        if size is not None:
            total += size
            if entry is not None:
                for dropped in entry.window()[max(0, entry.keep_versions - 1) :]:
                    total -= dropped.size or 0
                    held -= len(dropped.replicas)
        after = TenantUsage(adapters, total, held)
        for quota, limit, used, was, unit in (
            ("max_adapters", self.max_adapters, after.adapters, now.adapters, "adapter names"),
            ("max_bytes", self.max_bytes, after.bytes, now.bytes, "bytes"),
            ("max_slots", self.max_slots if slots else None, after.slots, now.slots, "slots"),
        ):
            if limit is not None and used > limit and used > was:
                raise TenantQuotaExceeded(
                    f"tenant {self.id!r}: {quota} quota exceeded by {name!r}: the limit is "
                    f"{limit} {unit}; the tenant holds {was}, and this would make {used}",
                    quota=quota,
                    limit=limit,
                    usage=used,
                )
        return after


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request: the operator (``tenant`` None: every name) or one tenant."""

    tenant: Tenant | None = None

    @property
    def is_operator(self) -> bool:
        return self.tenant is None

    def owns(self, name: str) -> bool:
        """Whether this caller may name adapter ``name``."""
        return self.tenant is None or self.tenant.owns(name)


OPERATOR = Caller()
"""The operator: its token (the control token, the inference key, the trainer token) or an open
service; every name is its."""


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: list[Tenant] = Field(default_factory=list)


class Tenants:
    """The tenants of a fleet, as a tenants file lists them."""

    def __init__(self, tenants: Sequence[Tenant]) -> None:
        ids = [t.id for t in tenants]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise InvalidRequest(f"tenant ids must be unique: {', '.join(dup)}", param="id")
        digests = [t.digest for t in tenants]
        if len(set(digests)) != len(digests):
            raise InvalidRequest("two tenants have the same token", param="token")
        self.tenants: tuple[Tenant, ...] = tuple(tenants)
        self._digests = digests

    def __len__(self) -> int:
        return len(self.tenants)

    def __iter__(self):
        return iter(self.tenants)

    @classmethod
    def parse(cls, doc: object) -> Tenants:
        """Tenants from a parsed file (``{"tenant": [...]}``). Raises ``InvalidRequest``."""
        try:
            parsed = _File.model_validate(doc)
        except ValidationError as exc:
            first = exc.errors()[0]
            cause = (first.get("ctx") or {}).get("error")
            where = ".".join(str(p) for p in first.get("loc", ()))
            msg = cause.message if isinstance(cause, InvalidRequest) else first.get("msg")
            raise InvalidRequest(f"{where}: {msg}" if where else str(msg)) from None
        return cls(parsed.tenant)

    @classmethod
    def load(cls, path: str | Path) -> Tenants:
        """Read a tenants file: TOML, or JSON when it ends in ``.json``. Raises
        ``InvalidRequest`` (a ``ValueError``) naming the file and the problem."""
        p = Path(path)
        try:
            raw = p.read_bytes()
            doc = json.loads(raw) if p.suffix == ".json" else tomllib.loads(raw.decode())
            return cls.parse(doc)
        except (OSError, ValueError) as exc:
            detail = exc.message if isinstance(exc, InvalidRequest) else str(exc)
            raise InvalidRequest(f"tenants file {str(p)!r}: {detail}") from None

    def owner(self, name: str) -> Tenant | None:
        """The first tenant (in file order) whose patterns match adapter ``name``, if any: the
        one whose quotas a name registered or placed by the operator counts against."""
        return next((t for t in self.tenants if t.owns(name)), None)

    def identify(self, authorization: str | bytes | None) -> Tenant | None:
        """The tenant whose token ``authorization`` (``Bearer <token>``) carries, or None.

        Every tenant's digest is compared, in constant time and without stopping at a match,
        so the time taken says nothing about which tenant (if any) a token belongs to.
        """
        token = _bearer(authorization)
        if token is None:
            return None
        presented = token_digest(token)
        found: Tenant | None = None
        for tenant, digest in zip(self.tenants, self._digests, strict=True):
            if hmac.compare_digest(presented, digest) and found is None:
                found = tenant
        return found


def _bearer(authorization: str | bytes | None) -> bytes | None:
    """The token of a ``Bearer`` header (None: no header, another scheme, or empty)."""
    if not authorization:
        return None
    if isinstance(authorization, str):
        authorization = authorization.encode("latin-1", "replace")
    scheme, _, token = authorization.partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        return None
    return token
