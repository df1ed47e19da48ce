"""``AsyncRouterClient``: the router's control plane for the Publisher and operators, and the
data-plane calls lorafleet itself makes (``finish_session``).

The two planes are guarded by different secrets: control calls carry the control ``token``,
data-plane calls the router's inference ``api_key``; the client holds each and sends the one
the call needs.

Errors: ``RemoteError`` (the router answered with an error; ``.code`` is the protocol code, e.g.
``version_conflict`` or ``publish_in_progress``) and ``TransportError`` (no answer).
"""

from __future__ import annotations

from urllib.parse import quote

import httpx

from lorafleet._http import async_client, bearer, map_transport_errors, raise_for_status
from lorafleet.protocol.canary import CanaryVerdict
from lorafleet.protocol.router import (
    AddReplicaRequest,
    AliasEntry,
    AliasTable,
    CopyList,
    CopyReport,
    DrainRequest,
    DrainResponse,
    LagState,
    Lease,
    LeaseRequest,
    MoveReplicaRequest,
    PinRecord,
    PinRequest,
    RegisterRequest,
    RegisterResult,
    ReplicaList,
    ReplicaStatus,
    Reservation,
    ReserveRequest,
    RoomRequest,
    RoomResult,
    SessionPolicy,
    SetAliasRequest,
    Snapshot,
    WarmRequest,
    WarmResult,
)

__all__ = ["NO_CAS", "AsyncRouterClient"]


class _NoCas:
    def __repr__(self) -> str:
        return "NO_CAS"


NO_CAS = _NoCas()
"""``set_alias(expected_version=NO_CAS)``: flip without compare-and-set."""


class AsyncRouterClient:
    """The router's client. ``token``: the control token, sent on control calls; ``api_key``:
    the inference key, sent on data-plane calls (None: the router's data plane is open). Pass
    ``client`` to share a connection pool; else one is owned."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        client: httpx.AsyncClient | None = None,
        *,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = bearer(token)
        self._data_headers = bearer(api_key)
        self._owned = client is None
        self._client = client or async_client(timeout=httpx.Timeout(30.0, connect=5.0))

    async def __aenter__(self) -> AsyncRouterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owned:
            await self._client.aclose()

    async def _call(
        self, method: str, path: str, *, headers: dict[str, str] | None = None, **kw
    ) -> httpx.Response:
        """One call, with the control token unless ``headers`` (a data-plane call's) is given."""
        url = self.base_url + path
        with map_transport_errors(url):
            resp = await self._client.request(
                method, url, headers=self._headers if headers is None else headers, **kw
            )
        return raise_for_status(resp)

    async def table(self, *, log: bool = True) -> AliasTable:
        """The alias table; ``log=False`` leaves the flip log out (what a publication needs)."""
        params = None if log else {"log": "false"}
        r = await self._call("GET", "/v1/control/aliases", params=params)
        return AliasTable.model_validate_json(r.content)

    async def set_alias(
        self,
        name: str,
        version: int,
        engine_name: str,
        replicas: list[str],
        expected_version: int | _NoCas | None = NO_CAS,
        lease_holder: str | None = None,
        *,
        keep_versions: int = 1,
        max_staleness: int | None = None,
        sessions: SessionPolicy = "pin",
        digest: str | None = None,
        lagging: dict[str, LagState] | None = None,
        canary: dict[str, CanaryVerdict] | None = None,
        placement: list[str] | None = None,
        size: int | None = None,
        release_lease: bool = False,
    ) -> AliasEntry:
        """Flip ``name`` to ``version``, keeping the newest ``keep_versions`` routable.

        Compare-and-set: ``expected_version`` is the active version the caller saw (``None``: no
        alias may exist yet); the default ``NO_CAS`` skips the check.

        Raises ``VersionConflict`` (CAS failed or not newer) or ``PublishInProgress`` (another
        holder's lease). ``replicas`` hold it verified with ``digest``; ``lagging`` (a quorum
        publication): the replicas that did not take it, and why; ``canary``: how each of
        ``replicas`` answered the trainer's canary (kept in the table); ``placement``: the name's
        placement set (None: every replica); ``size``: the bundle's bytes; ``release_lease``:
        give ``lease_holder``'s lease back in the same write.
        """
        req = SetAliasRequest(
            version=version,
            engine_name=engine_name,
            replicas=replicas,
            lease_holder=lease_holder,
            keep_versions=keep_versions,
            max_staleness=max_staleness,
            sessions=sessions,
            digest=digest,
            lagging=lagging or {},
            canary=canary or {},
            placement=placement,
            size=size,
            release_lease=release_lease,
        )
        body = req.model_dump(exclude={"expected_version"})
        if not isinstance(expected_version, _NoCas):
            body["expected_version"] = expected_version
        r = await self._call("PUT", f"/v1/control/aliases/{quote(name, safe='')}", json=body)
        return AliasEntry.model_validate_json(r.content)

    async def delete_alias(self, name: str, lease_holder: str | None = None) -> None:
        params = {"lease_holder": lease_holder} if lease_holder else None
        await self._call("DELETE", f"/v1/control/aliases/{quote(name, safe='')}", params=params)

    async def drain(self, name: str, version: int, timeout_s: float = 30.0) -> DrainResponse:
        """Wait until ``version`` of ``name`` has nothing in flight (or the timeout passes)."""
        body = DrainRequest(version=version, timeout_s=timeout_s).model_dump()
        path = f"/v1/control/aliases/{quote(name, safe='')}/drain"
        with map_transport_errors(self.base_url + path):
            resp = await self._client.post(
                self.base_url + path,
                json=body,
                headers=self._headers,
                timeout=httpx.Timeout(timeout_s + 30.0, connect=5.0),
            )
        return DrainResponse.model_validate_json(raise_for_status(resp).content)

    async def reserve(self, name: str, holder: str, version: int | None = None) -> int:
        """The next version number of ``name`` (never handed out twice; see the router)."""
        return (await self.begin(name, holder, version)).version

    async def begin(
        self,
        name: str,
        holder: str,
        version: int | None = None,
        lease_ttl_s: float | None = None,
    ) -> Reservation:
        """A version number of ``name``, with ``lease_ttl_s`` the lease too, in one durable
        step; the answer carries the name's alias (a publication's plan in one round trip)."""
        body = ReserveRequest(holder=holder, version=version, lease_ttl_s=lease_ttl_s).model_dump()
        r = await self._call(
            "POST", f"/v1/control/aliases/{quote(name, safe='')}/reserve", json=body
        )
        return Reservation.model_validate_json(r.content)

    async def release_version(self, name: str, holder: str, version: int) -> None:
        """Give ``version`` back: the attempt that took it reached no engine."""
        await self._call(
            "DELETE",
            f"/v1/control/aliases/{quote(name, safe='')}/reserve/{version}",
            params={"holder": holder},
        )

    async def acquire_lease(self, name: str, holder: str, ttl_s: float = 300.0) -> Lease:
        """Take or renew the publish lease; RemoteError ``publish_in_progress`` if held."""
        body = LeaseRequest(holder=holder, ttl_s=ttl_s).model_dump()
        r = await self._call("POST", f"/v1/control/leases/{quote(name, safe='')}", json=body)
        return Lease.model_validate_json(r.content)

    async def release_lease(self, name: str, holder: str) -> None:
        await self._call(
            "DELETE", f"/v1/control/leases/{quote(name, safe='')}/{quote(holder, safe='')}"
        )

    async def break_lease(self, name: str) -> None:
        """An operator's override: remove the lease on ``name`` whoever holds it."""
        await self._call("DELETE", f"/v1/control/leases/{quote(name, safe='')}")

    async def replicas(self) -> ReplicaList:
        r = await self._call("GET", "/v1/control/replicas")
        return ReplicaList.model_validate_json(r.content)

    async def move_replica(self, replica_id: str, agent_url: str) -> ReplicaStatus:
        """Tell the router ``replica_id`` was re-placed and answers at ``agent_url`` now."""
        r = await self._call(
            "PUT",
            f"/v1/control/replicas/{quote(replica_id, safe='')}",
            json=MoveReplicaRequest(agent_url=agent_url).model_dump(),
        )
        return ReplicaStatus.model_validate_json(r.content)

    async def add_replica(self, agent_url: str) -> ReplicaStatus:
        """A replica joins the fleet; catch-up feeds it before it is routed anything."""
        body = AddReplicaRequest(agent_url=agent_url).model_dump()
        r = await self._call("POST", "/v1/control/replicas", json=body)
        return ReplicaStatus.model_validate_json(r.content)

    async def remove_replica(self, replica_id: str, drain_s: float = 30.0) -> ReplicaStatus:
        """A replica leaves: off every version, drained (up to ``drain_s``), forgotten."""
        r = await self._call(
            "DELETE",
            f"/v1/control/replicas/{quote(replica_id, safe='')}",
            params={"drain_s": drain_s},
            timeout=httpx.Timeout(drain_s + 30.0, connect=5.0),
        )
        return ReplicaStatus.model_validate_json(r.content)

    # -- data plane (the inference key) -------------------------------------------------------
    async def finish_session(self, session_id: str) -> None:
        """End a sticky session: the router forgets its replica and its versions. A data-plane
        call: it carries ``api_key``, not the control token."""
        await self._call(
            "POST",
            "/finish_session",
            params={"session_id": session_id},
            headers=self._data_headers,
            timeout=10.0,
        )

    # --- data-plane copies ---------------------------------------------------------------------

    async def sync(self, report: CopyReport, wait: float) -> Snapshot:
        """A data-plane copy's long poll (``router/copies.py``): its report in, the table out,
        at once when something changed for it, else after ``wait`` seconds."""
        r = await self._call(
            "POST",
            "/v1/control/sync",
            params={"wait": wait},
            content=report.model_dump_json(),
            headers={**self._headers, "content-type": "application/json"},
            timeout=httpx.Timeout(wait + 10.0, connect=2.0),
        )
        return Snapshot.model_validate_json(r.content)

    async def pin(self, session: str, name: str, timeout: float = 2.0) -> PinRecord:
        """A session's pin on ``name`` while a flip of it is under way."""
        body = PinRequest(session=session, name=name).model_dump()
        r = await self._call(
            "POST", "/v1/control/pins", json=body, timeout=httpx.Timeout(timeout, connect=1.0)
        )
        return PinRecord.model_validate_json(r.content)

    async def warm(
        self, name: str, version: int | None = None, timeout: float = 600.0, more: bool = False
    ) -> WarmResult:
        """Place a cold version of ``name`` (None: the newest) on a replica (with ``more``: on
        one more replica than holds it): loaded, proven, listed (docs/placement.md).
        ``AdapterCold`` when it could be loaded nowhere."""
        body = WarmRequest(version=version, more=more).model_dump()
        r = await self._call(
            "POST",
            f"/v1/control/aliases/{quote(name, safe='')}/warm",
            json=body,
            timeout=httpx.Timeout(timeout, connect=3.0),
        )
        return WarmResult.model_validate_json(r.content)

    async def register(self, name: str, path: str, keep_versions: int = 2) -> RegisterResult:
        """Register the PEFT directory ``path`` by reference as ``name``'s next version: read
        once by the router, loaded where a request places it (docs/placement.md). Raises
        ``PathNotAllowed`` (outside the router's roots) and ``AdapterInvalid``."""
        body = RegisterRequest(name=name, path=path, keep_versions=keep_versions).model_dump()
        r = await self._call(
            "POST",
            "/v1/control/registrations",
            json=body,
            timeout=httpx.Timeout(600.0, connect=3.0),
        )
        return RegisterResult.model_validate_json(r.content)

    async def resolve(self, name: str, timeout: float = 600.0) -> AliasEntry:
        """``name``'s entry, registered first from a watched directory if it is not in the
        table yet. ``NotFound`` when no watched directory holds it either."""
        r = await self._call(
            "POST",
            f"/v1/control/aliases/{quote(name, safe='')}/resolve",
            timeout=httpx.Timeout(timeout, connect=3.0),
        )
        return AliasEntry.model_validate_json(r.content)

    async def make_room(
        self, replica_id: str, need: int = 1, keep: list[str] | None = None
    ) -> RoomResult:
        """Free ``need`` slots on ``replica_id``'s engine by evicting its least recently used
        versions of names other than ``keep``, drained first. ``NoRoom`` (409) if it cannot."""
        body = RoomRequest(need=need, keep=keep or []).model_dump()
        r = await self._call(
            "POST",
            f"/v1/control/replicas/{quote(replica_id, safe='')}/room",
            json=body,
            timeout=httpx.Timeout(600.0, connect=3.0),
        )
        return RoomResult.model_validate_json(r.content)

    async def copies(self) -> CopyList:
        """The data-plane copies the control plane knows, each with its table seq."""
        r = await self._call("GET", "/v1/control/copies")
        return CopyList.model_validate_json(r.content)
