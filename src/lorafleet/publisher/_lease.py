"""A publication's lease on a name at the router (one publisher of a name at a time)."""

from __future__ import annotations

import asyncio
import contextlib

from lorafleet.clients.router import AsyncRouterClient
from lorafleet.errors import LorafleetError

__all__ = ["Lease"]


class Lease:
    """A publication's lease on a name at the router: renewed while the publication runs,
    given back by its flip (``released``) or at its end."""

    def __init__(self, router: AsyncRouterClient, name: str, holder: str, ttl: float) -> None:
        self.router, self.name, self.holder, self.ttl = router, name, holder, ttl
        self.released = False
        """The flip gave it back (``SetAliasRequest.release_lease``)."""
        # A long upload must not outlive the lease: renew it while the publication runs.
        self._heartbeat = asyncio.create_task(self._keep())

    async def stop_renewing(self) -> None:
        """Renew no more: a renewal must not land after the lease is given back and hold the
        name again, so one in flight is waited for."""
        self._heartbeat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._heartbeat

    async def end(self) -> None:
        await self.stop_renewing()
        if not self.released:
            await self.router.release_lease(self.name, self.holder)

    async def _keep(self) -> None:
        # A periodic renewal, not a retry: a failed one is simply tried again at the next beat,
        # well before the lease (three beats long) runs out.
        while True:
            await asyncio.sleep(self.ttl / 3)
            with contextlib.suppress(LorafleetError):
                await self.router.acquire_lease(self.name, self.holder, self.ttl)
