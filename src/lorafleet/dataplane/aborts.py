"""Aborting requests by their ``rid`` (SGLang's ``/abort_request``), on every engine kind.

A request the data plane translated for an engine (``shapes/sglang_translate.py``) is registered
here while it runs; an abort ends its upstream stream, and it answers with what it had generated
and finish reason ``abort``. An engine that aborts by itself (its kind's ``abort_route``) gets the
call as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp

from lorafleet.dataplane.balancer import Replica
from lorafleet.dataplane.upstream import JSON_HEADERS
from lorafleet.engine_kinds import engine_kind

__all__ = ["Live", "LiveRequests"]


@dataclass(eq=False)
class Live:
    """A translated request in flight: what an abort sets."""

    rid: str
    replica: Replica
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


class LiveRequests:
    """The translated requests in flight on one data plane, by ``rid``."""

    def __init__(self) -> None:
        self._by_rid: dict[str, set[Live]] = {}

    @contextlib.contextmanager
    def running(self, rid: str, replica: Replica) -> Iterator[Live]:
        """Register a request for as long as the block runs."""
        live = Live(rid, replica)
        self._by_rid.setdefault(rid, set()).add(live)
        try:
            yield live
        finally:
            peers = self._by_rid.get(rid)
            if peers is not None:
                peers.discard(live)
                if not peers:
                    del self._by_rid[rid]

    async def abort(
        self,
        session: aiohttp.ClientSession,
        rid: str,
        abort_all: bool,
        replicas: list[Replica],
    ) -> int:
        """Abort ``rid`` (or everything) on ``replicas``; how many translated requests were
        ended. Engines with an abort route of their own get the call too."""
        ended = 0
        for lives in list(self._by_rid.values()):
            for live in lives:
                if live.replica in replicas and (abort_all or live.rid == rid):
                    live.aborted.set()
                    ended += 1
        body = json.dumps({"rid": rid, "abort_all": abort_all}).encode()

        async def one(r: Replica, route: str) -> None:
            with contextlib.suppress(Exception):
                resp = await session.post(f"{r.engine_url}{route}", data=body, headers=JSON_HEADERS)
                resp.release()

        calls = [
            one(r, route)
            for r in replicas
            if r.engine_url is not None and (route := engine_kind(r.kind).abort_route)
        ]
        await asyncio.gather(*calls)
        return ended
