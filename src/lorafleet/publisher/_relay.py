"""The relay transfer: each file leaves the Publisher once and is forwarded agent to agent.

For each file, the replicas that lack it form a tree in the order the Publisher was given its
agents: of fan-out ``relay_fanout`` when one is given (1 is a chain), planned otherwise from how
many replicas lack the file, its size and the relay rates (``protocol/relay.py``).
The Publisher sends the file to the tree's root; every agent forwards it to its children while
it streams in, and each verifies its own copy (size and sha-256, as for a direct upload). Trust
is per publication: every session is opened with the sha-256 of a credential minted here, and
only forwarding agents are given the credential itself, with the targets they may send to.

What can go wrong, and what then happens:

- a hop refuses its copy's bytes (``size_mismatch``, ``digest_mismatch``, ``size_exceeded``):
  that replica fails like a failed direct upload, and the publication rolls back;
- a hop dies, stalls or loses its connection: the copies downstream of it stop at a durable
  prefix; its subtree is re-parented onto the replicas that have a verified copy, each of which
  sends the rest from that prefix (``/v1/blobs/send``; spread over them, least used first), so
  the trainer's link carries nothing more. Only when no replica has the file (the root died
  before finishing it) does the Publisher send it again, once, and the others are then fed
  from that copy. An agent that restarted gets a new session, fed the same way. A replica still
  unreachable fails.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Sequence

from lorafleet.errors import (
    LorafleetError,
    TransportError,
    UploadNotFound,
    error_for,
)
from lorafleet.protocol.agent import (
    BlobSendRequest,
    FileProgress,
    ForwardTarget,
    RelayAccept,
    RelayHop,
    credential_digest,
)
from lorafleet.protocol.errors import STATUS_BY_CODE, ErrorCode
from lorafleet.protocol.manifest import FileEntry
from lorafleet.protocol.relay import forward_plans, measure, plan_fanout
from lorafleet.publisher._plan import Plan
from lorafleet.publisher._replica import ReplicaTxn

__all__ = ["Relay"]

# A copy refused for its bytes fails its replica (no second try: as for a direct upload).
_INTEGRITY = {ErrorCode.SIZE_MISMATCH, ErrorCode.DIGEST_MISMATCH, ErrorCode.SIZE_EXCEEDED}
_SETTLE_POLL_S = 0.1

log = logging.getLogger("lorafleet.publisher")


def _refusal(code: str | None, detail: str | None) -> BaseException:
    code = code or "http_error"
    return error_for(code, detail or code, status=STATUS_BY_CODE.get(code, 422))


class Relay:
    """Moves one publication's files to every replica; see the module docstring."""

    def __init__(self, plan: Plan, replicas: Sequence[ReplicaTxn]) -> None:
        self.plan = plan
        self.replicas = list(replicas)
        self.credential = secrets.token_urlsafe(32)
        self.accept = RelayAccept(
            credential_sha256=credential_digest(self.credential), stall_s=plan.relay_stall_s
        )
        self.failed: dict[str, BaseException] = {}
        """Replica id -> why its copy could not be completed."""
        self._direct: set[str] = set()
        """Replicas whose session was re-opened: later files go to them outside the trees."""
        self._done: dict[str, list[ReplicaTxn]] = {}
        """File path -> the replicas holding a verified copy of it (donors for repairs)."""
        self.fanouts: dict[str, int] = {}
        """File path -> the fan-out of the tree it moved down."""
        self._donated: dict[str, int] = {}
        """Replica id -> repairs it was asked to send (spread over the donors)."""

    async def run(self) -> dict[str, BaseException]:
        """Open every session, then move each file; returns the replicas that failed (empty:
        every replica holds every file, verified, in its open session)."""
        t = time.perf_counter()
        opened = await asyncio.gather(
            *(r.open(self.accept) for r in self.replicas), return_exceptions=True
        )
        for rep, out in zip(self.replicas, opened, strict=True):
            if isinstance(out, BaseException):
                self.failed[rep.id] = out
        if self.failed:
            return self.failed
        for entry in self.plan.bundle.manifest.files:
            await self._move(entry)
            if self.failed:
                break
        for rep in self.replicas:
            rep.timing.upload_s = time.perf_counter() - t
        return self.failed

    def _holders(self, entry: FileEntry) -> list[ReplicaTxn]:
        return [
            r
            for r in self.replicas
            if r.id not in self.failed and r.id not in self._direct and entry.path in r.missing
        ]

    async def _move(self, entry: FileEntry) -> None:
        """One file: a tree over the replicas that lack it, then repair whatever did not land
        from a replica that has it (the trainer only when none has)."""
        holders = self._holders(entry)
        direct = [r for r in self.replicas if r.id in self._direct and entry.path in r.missing]
        # Replicas that held the file before this publication are donors from the start.
        self._done[entry.path] = [
            r for r in self.replicas if r.id not in self.failed and entry.path not in r.missing
        ]
        await asyncio.gather(*(self._repair(r, entry) for r in direct))
        if not holders:
            return
        fanout = self.plan.relay_fanout or plan_fanout(
            len(holders), entry.size, self.plan.relay_rates
        )
        self.fanouts[entry.path] = fanout
        plans = forward_plans(
            [
                ForwardTarget(url=h.agent.url, upload_id=h.upload_id or "", answer_timeout_s=1.0)
                for h in holders
            ],
            entry.path,
            fanout,
            self.credential,
            self.plan.relay_stall_s,
        )
        installed = await asyncio.gather(
            *(
                holders[i].agent.client.set_forward(holders[i].upload_id or "", p)
                for i, p in plans.items()
            ),
            return_exceptions=True,
        )
        for i, out in zip(plans, installed, strict=True):
            if isinstance(out, BaseException):
                # Its subtree is fed by the repair below (a replica with a copy, or the trainer).
                log.warning("%s refused its forward plan: %s", holders[i].id, out)
        root = holders[0]
        verdicts: dict[str, RelayHop | FileProgress] = {}
        t = time.perf_counter()
        try:
            prog = await root.send(entry)
        except (LorafleetError, TimeoutError):
            pass  # the root's own copy is settled below like any other
        else:
            verdicts[root.upload_id or ""] = prog
            verdicts.update((hop.upload_id, hop) for hop in prog.relayed)
            self._measured(entry, fanout, time.perf_counter() - t, holders, verdicts)
        pending = []
        for r in holders:
            verdict = verdicts.get(r.upload_id or "")
            if isinstance(verdict, FileProgress) and verdict.complete:
                self._done[entry.path].append(r)
            elif isinstance(verdict, RelayHop) and verdict.ok:
                r.timing.bytes_relayed += entry.size
                self._done[entry.path].append(r)
            elif isinstance(verdict, RelayHop) and verdict.code in _INTEGRITY:
                self.failed[r.id] = _refusal(verdict.code, verdict.detail)
            else:
                pending.append(r)
        # What a dead or stalled hop cut off (its subtree) is re-parented onto the replicas
        # that have the file, each copy resumed from its durable prefix.
        await asyncio.gather(*(self._repair(r, entry) for r in pending))

    def _measured(
        self,
        entry: FileEntry,
        fanout: int,
        seconds: float,
        holders: Sequence[ReplicaTxn],
        verdicts: dict[str, RelayHop | FileProgress],
    ) -> None:
        """Tell the plan's listener what a tree that landed whole took (``protocol/relay.py``)."""
        if self.plan.on_relay_measure is None:
            return
        root = verdicts.get(holders[0].upload_id or "")
        hops = [verdicts.get(h.upload_id or "") for h in holders[1:]]
        whole = isinstance(root, FileProgress) and root.complete
        if not whole or not all(isinstance(v, RelayHop) and v.ok for v in hops):
            return  # a broken tree's time is its repair's, not the rates'
        m = measure(entry.size, fanout, seconds, [v.seconds for v in hops])  # type: ignore[union-attr]
        if m is not None:
            self.plan.on_relay_measure(m)

    async def _repair(self, rep: ReplicaTxn, entry: FileEntry) -> None:
        """Give ``rep`` the rest of ``entry`` from its durable prefix: from a replica that has
        a verified copy, or from the Publisher when none has (or none could send)."""
        files = self.plan.bundle.manifest.files
        try:
            if rep.id in self._direct:
                if entry.path in rep.missing:
                    await self._fill(rep, entry, None)
                return
            state = await self._wait_idle(rep, entry)
            if state is None:
                # Re-opened (the agent restarted and lost the session): from now on everything
                # it lacks is sent to it outside the trees, the files moved before this one
                # included.
                self._direct.add(rep.id)
                for f in files[: files.index(entry) + 1]:
                    if f.path in rep.missing:
                        await self._fill(rep, f, None)
                return
            if state.complete:
                self._done[entry.path].append(rep)
                return
            if state.error_code in _INTEGRITY:
                self.failed[rep.id] = _refusal(state.error_code, state.error)
                return
            await self._fill(rep, entry, state.offset)
        except (LorafleetError, TimeoutError) as exc:
            self.failed[rep.id] = exc

    async def _fill(self, rep: ReplicaTxn, entry: FileEntry, offset: int | None) -> None:
        """Send ``rep`` ``entry`` from ``offset`` (None: ask its agent): each replica with a
        verified copy is asked in turn, least used first; the Publisher sends only if none
        could. Raises what the Publisher's own send raises."""
        for donor in sorted(
            (d for d in self._done.get(entry.path, []) if d is not rep and d.id not in self.failed),
            key=lambda d: self._donated.get(d.id, 0),
        ):
            if offset is None:
                offset = await rep.agent.client.upload_offset(rep.upload_id or "", entry.path)
            self._donated[donor.id] = self._donated.get(donor.id, 0) + 1
            stall = self.plan.relay_stall_s
            req = BlobSendRequest(
                entry=entry,
                target=ForwardTarget(
                    url=rep.agent.url, upload_id=rep.upload_id or "", answer_timeout_s=stall + 10
                ),
                credential=self.credential,
                offset=offset,
                stall_s=stall,
            )
            try:
                got = await donor.agent.client.send_blob(req, timeout_s=stall * 4 + 30)
            except (LorafleetError, TimeoutError) as exc:
                log.warning("%s could not send %s to %s: %s", donor.id, entry.path, rep.id, exc)
                continue
            hop = got.hops[0]
            if hop.ok:
                rep.timing.bytes_relayed += got.bytes_sent
                self._done[entry.path].append(rep)
                return
            if hop.code in _INTEGRITY:
                raise _refusal(hop.code, hop.detail)
            log.warning("%s could not send %s to %s: %s", donor.id, entry.path, rep.id, hop)
            offset = None  # some of it may have landed: ask again
        await rep.send(entry, resume=True)
        self._done[entry.path].append(rep)

    async def _wait_idle(self, rep: ReplicaTxn, entry: FileEntry) -> FileProgress | None:
        """The file's state once no PUT writes it (a relayed one ends within its stall limit).
        Re-opens the session, without relay, if the agent lost it (it restarted): None then."""
        deadline = time.monotonic() + 2 * self.plan.relay_stall_s + 5.0
        while True:
            try:
                status = await rep.agent.client.upload_status(rep.upload_id or "")
            except UploadNotFound:
                await rep.open(self.accept)  # peers may send into the new session too
                return None
            except TransportError:
                # Down, perhaps restarting (a supervisor's job): ask again until the deadline.
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(_SETTLE_POLL_S * 3)
                continue
            state = next(f for f in status.files if f.path == entry.path)
            if not state.receiving or time.monotonic() > deadline:
                return state
            await asyncio.sleep(_SETTLE_POLL_S)
