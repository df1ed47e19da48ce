"""The relay transfer: each file leaves the Publisher once and is forwarded agent to agent.

For each file, the replicas that lack it form a tree in the order the Publisher was given its
agents (fan-out ``relay_fanout``; 1 is a chain, the fastest where each host's link is the limit).
The Publisher sends the file to the tree's root; every agent forwards it to its children while
it streams in, and each verifies its own copy (size and sha-256, as for a direct upload). Trust
is per publication: every session is opened with the sha-256 of a credential minted here, and
only forwarding agents are given the credential itself, with the targets they may send to.

What can go wrong, and what then happens:

- a hop refuses its copy's bytes (``size_mismatch``, ``digest_mismatch``, ``size_exceeded``):
  that replica fails like a failed direct upload, and the publication rolls back;
- a hop dies, stalls or loses its connection: the copies downstream of it stop at a durable
  prefix; the Publisher resumes each of them itself from that prefix (and re-opens a session on
  an agent that restarted), so the publication goes on. A replica still unreachable fails.
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
    FileProgress,
    ForwardPlan,
    ForwardTarget,
    RelayAccept,
    RelayHop,
    credential_digest,
)
from lorafleet.protocol.errors import STATUS_BY_CODE, ErrorCode
from lorafleet.protocol.manifest import FileEntry
from lorafleet.publisher._plan import Plan
from lorafleet.publisher._replica import ReplicaTxn

__all__ = ["Relay", "tree"]

# A copy refused for its bytes fails its replica (no second try: as for a direct upload).
_INTEGRITY = {ErrorCode.SIZE_MISMATCH, ErrorCode.DIGEST_MISMATCH, ErrorCode.SIZE_EXCEEDED}
_SETTLE_POLL_S = 0.1

log = logging.getLogger("lorafleet.publisher")


def tree(n: int, fanout: int) -> list[list[int]]:
    """Children of each of ``n`` nodes laid out breadth-first (node 0 is the root)."""
    return [list(range(i * fanout + 1, min(n, i * fanout + fanout + 1))) for i in range(n)]


def _refusal(code: str | None, detail: str | None) -> BaseException:
    code = code or "http_error"
    return error_for(code, detail or code, status=STATUS_BY_CODE.get(code, 422))


def _height(children: list[list[int]], i: int) -> int:
    return 1 + max((_height(children, c) for c in children[i]), default=0) if children[i] else 0


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
        """Replicas whose session was re-opened without relay: later files go to them direct."""

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
        """One file: a tree over the replicas that lack it, then repair whatever did not land."""
        holders = self._holders(entry)
        direct = [r for r in self.replicas if r.id in self._direct and entry.path in r.missing]
        await asyncio.gather(*(self._repair(r, entry) for r in direct))
        if not holders:
            return
        children = tree(len(holders), self.plan.relay_fanout)
        stall = self.plan.relay_stall_s
        plans = {
            i: ForwardPlan(
                credential=self.credential,
                stall_s=stall,
                files={
                    entry.path: [
                        ForwardTarget(
                            url=holders[c].agent.url,
                            upload_id=holders[c].upload_id or "",
                            answer_timeout_s=stall * (_height(children, c) + 1) + 10.0,
                        )
                        for c in kids
                    ]
                },
            )
            for i, kids in enumerate(children)
            if kids
        }
        installed = await asyncio.gather(
            *(
                holders[i].agent.client.set_forward(holders[i].upload_id or "", p)
                for i, p in plans.items()
            ),
            return_exceptions=True,
        )
        for i, out in zip(plans, installed, strict=True):
            if isinstance(out, BaseException):
                # Its subtree gets the file from the Publisher's repair below instead.
                log.warning("%s refused its forward plan: %s", holders[i].id, out)
        root = holders[0]
        verdicts: dict[str, RelayHop | FileProgress] = {}
        try:
            prog = await root.send(entry)
        except (LorafleetError, TimeoutError):
            pass  # the root's own copy is settled below like any other
        else:
            verdicts[root.upload_id or ""] = prog
            verdicts.update((hop.upload_id, hop) for hop in prog.relayed)
        await asyncio.gather(
            *(self._settle(r, entry, verdicts.get(r.upload_id or "")) for r in holders)
        )

    async def _settle(
        self, rep: ReplicaTxn, entry: FileEntry, verdict: RelayHop | FileProgress | None
    ) -> None:
        """Make sure ``rep`` ends with a verified copy of ``entry``, or record why it cannot."""
        if isinstance(verdict, FileProgress) and verdict.complete:
            return
        if isinstance(verdict, RelayHop):
            if verdict.ok:
                rep.timing.bytes_relayed += entry.size
                return
            if verdict.code in _INTEGRITY:
                self.failed[rep.id] = _refusal(verdict.code, verdict.detail)
                return
        await self._repair(rep, entry)

    async def _repair(self, rep: ReplicaTxn, entry: FileEntry) -> None:
        """Send ``rep`` the rest of ``entry`` from the Publisher, from its durable prefix."""
        files = self.plan.bundle.manifest.files
        try:
            if rep.id in self._direct:
                if entry.path in rep.missing:
                    await rep.send(entry, resume=True)
                return
            state = await self._wait_idle(rep, entry)
            if state is None:
                # Re-opened (the agent restarted and lost the session): from now on everything
                # it lacks goes to it direct, the files moved before this one included.
                self._direct.add(rep.id)
                for f in files[: files.index(entry) + 1]:
                    if f.path in rep.missing:
                        await rep.send(f, resume=True)
                return
            if state.complete:
                return
            if state.error_code in _INTEGRITY:
                self.failed[rep.id] = _refusal(state.error_code, state.error)
                return
            await rep.send(entry, resume=True)
        except (LorafleetError, TimeoutError) as exc:
            self.failed[rep.id] = exc

    async def _wait_idle(self, rep: ReplicaTxn, entry: FileEntry) -> FileProgress | None:
        """The file's state once no PUT writes it (a relayed one ends within its stall limit).
        Re-opens the session, without relay, if the agent lost it (it restarted): None then."""
        deadline = time.monotonic() + 2 * self.plan.relay_stall_s + 5.0
        while True:
            try:
                status = await rep.agent.client.upload_status(rep.upload_id or "")
            except UploadNotFound:
                await rep.open()
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
