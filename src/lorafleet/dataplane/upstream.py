"""Upstream: POSTs to one replica's engine over pooled connections.

A reused connection that fails before the answer (uvicorn closes idle keep-alive connections
after 5 s) is no sign of a sick replica: the request goes again, once, on a fresh connection, and
only that outcome counts. When nothing came back at all, ``Unreachable`` says whether the
connection was refused (nothing listens: the replica is out at once) or timed out or reset (one
failure of ``unhealthy_after``).
"""

from __future__ import annotations

import errno

import aiohttp

from lorafleet.dataplane.balancer import Replica
from lorafleet.dataplane.metrics import RouterMetrics

__all__ = ["JSON_HEADERS", "Unreachable", "Upstream", "client_session"]

JSON_HEADERS = {"Content-Type": "application/json"}
# A pooled connection the engine closed while idle fails like this when reused, before any
# response byte: resend once on a new connection.
_STALE_ERRORS = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
# Nothing could be sent: the replica is down or unreachable; try another one.
_CONNECT_ERRORS = (
    aiohttp.ClientConnectorError,
    aiohttp.ServerTimeoutError,  # includes the connect timeout (aiohttp.ConnectionTimeoutError)
)


class Unreachable(Exception):
    """Nothing came back from a replica; ``refused``: nothing listens there."""

    def __init__(self, detail: str, refused: bool) -> None:
        super().__init__(detail)
        self.detail, self.refused = detail, refused


def client_session(**connector: object) -> aiohttp.ClientSession:
    """A pooled session toward engines and agents: no total timeout (generations are long), a
    5 s connect timeout, bodies passed as they come (no decompression)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, **connector),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        auto_decompress=False,
        # Headers no engine reads: not built for every request.
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
    )


class Upstream:
    """POST to replicas: ``session`` pools connections; ``fresh`` (no reuse) is where a request
    goes again after a stale pooled connection."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        metrics: RouterMetrics,
        fresh: aiohttp.ClientSession | None = None,
    ) -> None:
        self.session = session
        self.fresh = fresh or session
        self.metrics = metrics

    async def post(self, replica: Replica, path: str, data: bytes) -> aiohttp.ClientResponse:
        """POST ``data`` to ``path`` on ``replica``'s engine. Raises ``Unreachable`` when nothing
        came back from it."""
        url = f"{replica.engine_url}{path}"
        try:
            try:
                return await self.session.post(url, data=data, headers=JSON_HEADERS)
            except _CONNECT_ERRORS:
                raise
            except _STALE_ERRORS:
                self.metrics.stale_retries.inc()
                return await self.fresh.post(url, data=data, headers=JSON_HEADERS)
        except (*_CONNECT_ERRORS, *_STALE_ERRORS) as exc:
            refused = (
                isinstance(exc, aiohttp.ClientConnectorError)
                and getattr(exc.os_error, "errno", None) == errno.ECONNREFUSED
            )
            raise Unreachable(f"{type(exc).__name__}: {exc}", refused) from exc
