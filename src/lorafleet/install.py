"""Installing one adapter version on one replica: stage its files, commit, load it into the
engine, prove the engine applies it, activate it.

This is the one path by which a version reaches a replica: a publication (``publisher/_replica.py``:
bytes from the trainer, a relay or a shared directory) and catch-up from a peer
(``router/catchup.py``) both take these steps, and whatever places a version next takes them too.
Each step is one agent call under its own bound. What a failure means is the caller's: a
publication rolls every replica back, catch-up backs off and tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from lorafleet.clients.agent import AsyncAgentClient, Sent, Source
from lorafleet.errors import InstallFailed, LorafleetError
from lorafleet.protocol.agent import (
    AdapterRecord,
    FileProgress,
    ForwardTarget,
    LoadMode,
    RelayAccept,
    SendRequest,
    UploadSession,
    credential_digest,
)
from lorafleet.protocol.canary import Canary, CanaryVerdict
from lorafleet.protocol.manifest import FileEntry, Manifest
from lorafleet.protocol.relay import RelayMeasure, RelayRates, forward_plans, measure, plan_fanout

__all__ = ["InstallTimeouts", "ReplicaInstall", "feed_tree"]

T = TypeVar("T")


@dataclass(frozen=True)
class InstallTimeouts:
    """Bounds in seconds for each kind of step."""

    call_s: float = 120.0
    """An agent call that moves no payload: open, commit, register, discard, activate."""
    transfer_s: float = 3600.0
    """Moving the bytes: one file pushed, or a peer sending what is missing."""
    load_s: float = 120.0
    """Loading into the engine, and proving that the engine applies it."""


class ReplicaInstall:
    """Version ``version`` of ``name`` onto the agent behind ``client``, step by step.

    ``manifest`` is what is being installed; None when the agent holds the version already and
    only the later steps (load, prove, activate) are asked of it.
    """

    def __init__(
        self,
        client: AsyncAgentClient,
        name: str,
        version: int,
        manifest: Manifest | None = None,
        timeouts: InstallTimeouts = InstallTimeouts(),
    ) -> None:
        self.client = client
        self.name = name
        self.version = version
        self.manifest = manifest
        self.timeouts = timeouts
        self.upload_id: str | None = None
        """The upload session opened here and not committed or discarded yet."""
        self.missing: list[str] = []
        """The paths the open session still needs (the agent holds the rest already)."""
        self.touched = False
        """The agent may hold something of this install (a session, a record, a load)."""
        self.load_attempted = False
        """A load was asked of the agent (it may have reached the engine)."""

    async def _bounded(self, call: Awaitable[T], bound: float) -> T:
        return await asyncio.wait_for(call, bound)

    # --- staging -------------------------------------------------------------------------------

    async def open(
        self, *, supersede: bool = False, relay: RelayAccept | None = None
    ) -> UploadSession:
        """Open (or re-open) the upload session for ``manifest``; ``relay``: peers may send
        into it with that credential."""
        assert self.manifest is not None, "open() needs the manifest being installed"
        self.touched = True
        session = await self._bounded(
            self.client.open_upload(self.manifest, supersede=supersede, relay=relay),
            self.timeouts.call_s,
        )
        self.upload_id, self.missing = session.upload_id, session.missing
        return session

    async def send(
        self,
        entry: FileEntry,
        source: Source,
        *,
        on_sent: Sent | None = None,
        resume: bool = False,
    ) -> FileProgress:
        """Push one file of the open session (``resume``: from the agent's durable offset)."""
        assert self.upload_id is not None, "send() needs an open session"
        return await self._bounded(
            self.client.upload_file(self.upload_id, entry, source, on_sent=on_sent, resume=resume),
            self.timeouts.transfer_s,
        )

    async def commit(self) -> AdapterRecord:
        """Commit the open session: the agent verifies the whole bundle and stages it."""
        assert self.upload_id is not None
        rec = await self._bounded(self.client.commit(self.upload_id), self.timeouts.call_s)
        self.upload_id = None  # committed: the agent closed the session and its staging
        return rec

    async def discard(self) -> None:
        """Drop the open session and what it staged. Raises ``LorafleetError``."""
        if self.upload_id is not None:
            await self._bounded(self.client.discard(self.upload_id), self.timeouts.call_s)
            self.upload_id = None

    async def register(self, path: str | os.PathLike, *, supersede: bool = False) -> AdapterRecord:
        """Stage from a directory the agent may read (a shared filesystem), verified there."""
        assert self.manifest is not None, "register() needs the manifest being installed"
        self.touched = True
        return await self._bounded(
            self.client.register_path(self.manifest, path, supersede=supersede),
            self.timeouts.call_s,
        )

    @classmethod
    async def registered(
        cls,
        client: AsyncAgentClient,
        manifest: Manifest,
        path: str | os.PathLike,
        timeouts: InstallTimeouts,
    ) -> ReplicaInstall:
        """A version registered by reference, onto the agent behind ``client``: staged from
        ``path`` (each file checked against ``manifest`` as the agent copies it) and loaded.
        An on-demand load does this; the proof is the caller's (``prove``)."""
        install = cls(client, manifest.name, manifest.version, manifest, timeouts)
        # Copying is bounded like a transfer, not like a call: the directory may be large.
        await install._bounded(
            client.register_path(manifest, path, supersede=True), timeouts.transfer_s
        )
        install.touched = True
        await install.load()
        return install

    @classmethod
    async def copied_from_peer(
        cls,
        client: AsyncAgentClient,
        peer: AsyncAgentClient,
        agent_url: str,
        name: str,
        version: int,
        timeouts: InstallTimeouts,
        digest: str | None = None,
    ) -> ReplicaInstall:
        """The version ``peer`` holds, onto the agent behind ``client`` (at ``agent_url``):
        its manifest from the peer (``InstallFailed`` when it is not ``digest``'s bytes),
        staged by ``from_peer`` and loaded. What catch-up and an on-demand load both do; the
        proof is the caller's (``prove``)."""
        manifest = await asyncio.wait_for(peer.manifest(name, version), timeouts.call_s)
        if digest is not None and manifest.digest != digest:
            raise InstallFailed(f"the peer holds other bytes under v{version}")
        install = cls(client, name, version, manifest, timeouts)
        await install.from_peer(peer, agent_url)
        await install.load()
        return install

    async def from_peer(self, peer: AsyncAgentClient, agent_url: str) -> None:
        """Stage from ``peer``, an agent that holds the version: this agent opens a session
        that takes relayed bytes under a credential minted for this install alone, the peer
        PUTs what is missing into it, this agent verifies each file as for any upload, and the
        session is committed. A failure discards the session and raises ``InstallFailed``,
        ``LorafleetError`` or ``TimeoutError``; the trainer's link carries nothing."""
        credential = secrets.token_urlsafe(32)
        accept = RelayAccept(credential_sha256=credential_digest(credential))
        # Not superseding: only a lease holder may clear newer never-activated versions, and
        # one may be a publication in flight on this replica (an older version conflicts
        # instead, and is tried again after it).
        await self.open(supersede=False, relay=accept)
        try:
            if self.missing:
                await self._peer_sends(peer, agent_url, credential, self.missing)
            await self.commit()
        except BaseException:
            with contextlib.suppress(LorafleetError, TimeoutError):
                await self.discard()
            raise

    async def _peer_sends(
        self, peer: AsyncAgentClient, agent_url: str, credential: str, paths: Sequence[str]
    ) -> None:
        assert self.upload_id is not None
        bound = self.timeouts.transfer_s
        req = SendRequest(
            name=self.name,
            version=self.version,
            target=ForwardTarget(url=agent_url, upload_id=self.upload_id, answer_timeout_s=bound),
            credential=credential,
            paths=list(paths),
        )
        sent = await self._bounded(peer.send(req, bound), bound)
        bad = [h for h in sent.hops if not h.ok]
        if bad or len(sent.hops) != len(paths):
            why = f"{bad[0].path}: {bad[0].code} {bad[0].detail}" if bad else "short"
            raise InstallFailed(f"the peer could not send it ({why})")

    # --- serving -------------------------------------------------------------------------------

    async def load(self, mode: LoadMode = "versioned") -> AdapterRecord:
        """Load the staged version into the engine."""
        self.load_attempted = True
        return await self._bounded(
            self.client.load(self.name, self.version, mode), self.timeouts.load_s
        )

    async def prove(self, canary: Canary | None = None) -> AdapterRecord:
        """Have the agent check that its engine applies the loaded version, addressed as the
        router will address it (its record's ``application``), and with ``canary`` that it
        answers the trainer's canary as the trainer did (its record's ``canary``). Raises
        ``AdapterNotApplied`` when the engine answers as the base model, ``CanaryMismatch``
        when it answers the canary otherwise; with a manifest, ``InstallFailed`` when the
        agent proved other bytes than those being installed."""
        rec = await self._bounded(
            self.client.verify(self.name, self.version, canary), self.timeouts.load_s
        )
        if self.manifest is not None and rec.digest != self.manifest.digest:
            raise InstallFailed(f"it proved other bytes ({rec.digest[:12]})")
        return rec

    async def canary_verdict(self) -> CanaryVerdict | None:
        """The canary verdict the agent recorded for this version (after a ``CanaryMismatch``:
        the figures); None when it cannot be read."""
        with contextlib.suppress(LorafleetError, TimeoutError):
            for rec in await self._bounded(self.client.list_adapters(), self.timeouts.call_s):
                if rec.name == self.name and rec.version == self.version:
                    return rec.canary
        return None

    async def activate(self) -> AdapterRecord:
        """Record the version as the name's active one on the agent."""
        return await self._bounded(
            self.client.activate(self.name, self.version), self.timeouts.call_s
        )


async def feed_tree(
    installs: Sequence[ReplicaInstall],
    urls: Sequence[str],
    peer: AsyncAgentClient,
    credential: str,
    *,
    stall_s: float = 10.0,
    rates: RelayRates = RelayRates(),
    on_measure: Callable[[RelayMeasure], None] | None = None,
) -> dict[int, str]:
    """Feed many installs of one version from one peer through a relay tree: their sessions
    are open (``open(relay=...)`` with ``credential``'s digest; ``urls[i]`` is the agent of
    ``installs[i]``); for each file, the ones that lack it form a tree planned by
    ``plan_fanout``, each forwarding while it receives, and ``peer`` sends it once, to the
    root. Every copy is verified by its own agent, as any upload. Nothing is committed here.
    Returns the installs (by index) whose copy did not land, and why: their callers feed them
    another way (``from_peer``); the rest hold every file. Each file's tree that landed whole
    is timed and its measurement given to ``on_measure`` (``protocol/relay.measure``), so that
    its caller learns the rates the next tree is planned with."""
    failed: dict[int, str] = {}
    manifest = installs[0].manifest
    assert manifest is not None
    for entry in manifest.files:
        idx = [i for i, x in enumerate(installs) if i not in failed and entry.path in x.missing]
        if not idx:
            continue
        targets = [
            ForwardTarget(url=urls[i], upload_id=installs[i].upload_id or "", answer_timeout_s=1.0)
            for i in idx
        ]
        fanout = plan_fanout(len(idx), entry.size, rates)
        plans = forward_plans(targets, entry.path, fanout, credential, stall_s)
        bound = installs[0].timeouts.transfer_s
        await asyncio.gather(
            *(
                installs[idx[k]]._bounded(
                    installs[idx[k]].client.set_forward(targets[k].upload_id, plan),
                    installs[idx[k]].timeouts.call_s,
                )
                for k, plan in plans.items()
            ),
            return_exceptions=True,  # a node that refused its plan: its subtree fails below
        )
        req = SendRequest(
            name=manifest.name,
            version=manifest.version,
            target=targets[0].model_copy(update={"answer_timeout_s": bound}),
            credential=credential,
            paths=[entry.path],
            stall_s=stall_s,
        )
        started = time.monotonic()
        try:
            sent = await asyncio.wait_for(peer.send(req, bound), bound)
        except (LorafleetError, TimeoutError) as exc:
            failed.update((i, f"{entry.path}: the peer could not send ({exc})") for i in idx)
            continue
        seconds = time.monotonic() - started
        verdicts = {h.upload_id: h for h in (*sent.hops, *sent.relayed)}
        hops = [verdicts.get(t.upload_id) for t in targets]
        for i, hop in zip(idx, hops, strict=True):
            if hop is None or not hop.ok:
                why = "no verdict" if hop is None else f"{hop.code}: {hop.detail}"
                failed[i] = f"{entry.path}: {why}"
        if on_measure is not None and all(h is not None and h.ok for h in hops):
            m = measure(entry.size, fanout, seconds, [h.seconds for h in hops[1:]])  # type: ignore[union-attr]
            if m is not None:
                on_measure(m)
    return failed
