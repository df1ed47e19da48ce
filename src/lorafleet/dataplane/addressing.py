"""Addressing: what a request's ``model`` (and session) names, resolved at arrival.

The rules (``protocol/router.py``): an alias is its newest routable version (or, for a session
on a name that pins sessions, the version the session started on); ``name@vN`` pins a version
inside the retention window and under ``max_staleness``; a base model's own name goes to any
replica serving it. One place for them, shared by every generation shape (``shapes/``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn, Protocol

from lorafleet.dataplane.balancer import Balancer
from lorafleet.errors import InvalidRequest, NotFound, StaleVersion, VersionNotRoutable
from lorafleet.protocol.names import check_engine_name
from lorafleet.protocol.router import AliasEntry, RoutableVersion
from lorafleet.protocol.tenants import Tenant, adapter_of

__all__ = ["Addressing", "Route", "TableView"]


class TableView(Protocol):
    """The alias table as the data plane reads it: the control plane's own store in one
    process, or the last snapshot a data-plane copy acknowledged."""

    @property
    def aliases(self) -> dict[str, AliasEntry]: ...


@dataclass(slots=True)
class Route:
    """What a request resolved to at arrival."""

    alias: str | None
    adapter: str | None
    version: int | None
    engine_name: str | None
    replicas: list[str] | None
    base_model: str | None
    lag: int = 0
    """How many versions behind the name's newest (a pin or a session's version)."""

    @property
    def key(self) -> tuple[str | None, int | None]:
        """What in-flight accounting and metrics count this request under."""
        return self.adapter, self.version

    @property
    def what(self) -> str:
        """How an error names what the request asked for."""
        if self.adapter is not None:
            return f"{self.adapter} v{self.version}"
        return self.alias or "the base model"


class Addressing:
    """Resolves ``model`` against the alias table and the replicas' base models."""

    def __init__(self, table: TableView, balancer: Balancer) -> None:
        self.table = table
        self.balancer = balancer

    def resolve(self, model: object, session: str | None = None) -> Route:
        """``model`` -> Route, at arrival (see the addressing rules in protocol/router.py).

        Raises ``NotFound`` for an unknown name, ``VersionNotRoutable`` for a pin (or a
        session's version) that does not exist or left the retention window, ``StaleVersion``
        past ``max_staleness``.
        """
        if model is None:
            return Route(None, None, None, None, None, None)
        if not isinstance(model, str):
            raise InvalidRequest("model must be a string", param="model")
        aliases = self.table.aliases
        entry = aliases.get(model)
        if entry is not None:
            if session is None or not entry.pins_sessions:
                ref = entry.window()[0]
            else:
                ref = self._session_version(entry, session)
            lag = entry.version - ref.version
            return Route(model, model, ref.version, ref.engine_name, ref.replicas, None, lag)
        name, at, v = model.rpartition("@v")
        if at and v.isdigit() and name in aliases:
            entry = aliases[name]
            ref = self._routable(entry, int(v), f"{model!r}")
            lag = entry.version - ref.version
            return Route(model, name, ref.version, ref.engine_name, ref.replicas, None, lag)
        if model in self.balancer.base_models():
            return Route(model, None, None, None, None, model)
        self.not_found(model)

    @staticmethod
    def not_found(model: str) -> NoReturn:
        """What a ``model`` that names nothing is answered: 400 ``invalid_name`` when no adapter
        (or pinned version, ``name@vN``) could ever have that name, else 404 ``not_found``."""
        check_engine_name(model, param="model")
        raise NotFound(f"The model `{model}` does not exist.", param="model")

    def check_scope(self, tenant: Tenant | None, model: object) -> None:
        """Refuse a ``model`` that is not ``tenant``'s exactly as ``resolve`` refuses a name that
        does not exist (``not_found``), whether it exists or not. Runs where a request's names
        are first seen, before anything (``admit``: a copy's gate, an on-demand load) acts on
        them. The operator (None) may name anything; a tenant its own names and the base models.
        """
        if tenant is None or not isinstance(model, str):
            return
        aliases = self.table.aliases
        # In resolve's order: an alias shadows a base model of the same name.
        if model not in aliases and model in self.balancer.base_models():
            return
        if not tenant.owns(adapter_of(model)):
            self.not_found(model)

    def _session_version(self, entry: AliasEntry, session: str) -> RoutableVersion:
        """The version ``session`` started on (pinned now if it is new)."""
        pinned = self.balancer.sessions.pin(session, entry.name, entry.version)
        return self._routable(entry, pinned, f"session {session!r}, which started on it,")

    @staticmethod
    def _routable(entry: AliasEntry, version: int, who: str) -> RoutableVersion:
        window = entry.window()
        listed = ", ".join(f"v{v.version}" for v in window)
        ref = next((v for v in window if v.version == version), None)
        if ref is None:
            oldest = min(v.version for v in window)
            if version > oldest:
                # Newer than the window's oldest yet not in it: never flipped to (not published
                # yet, or its attempt failed and the number was burnt).
                why = f"does not exist (the newest is v{entry.version})"
            else:
                why = f"is outside the retention window of {entry.keep_versions}"
            raise VersionNotRoutable(
                f"{entry.name!r} v{version} is not routable for {who}: it {why}; routable: {listed}"
            )
        lag = entry.version - version
        if lag > entry.staleness:
            raise StaleVersion(
                f"{entry.name!r} v{version} requested by {who} is {lag} version(s) behind v"
                f"{entry.version}, more than max_staleness {entry.staleness}; routable: {listed}"
            )
        return ref
