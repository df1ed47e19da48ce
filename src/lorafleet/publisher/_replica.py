"""One replica's part in a publication (``ReplicaTxn``), and the agent behind it (``Agent``).

An ``Agent`` lives as long as its Publisher: the connection and what the agent said about itself.
A ``ReplicaTxn`` lives for one publication: its upload session, its timing and whether the agent
may hold anything of it. Concurrent publications on one Publisher share agents, never
transactions.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Collection
from dataclasses import dataclass

from lorafleet.clients.agent import AsyncAgentClient
from lorafleet.errors import CanaryMismatch, EngineUnavailable, LorafleetError
from lorafleet.install import InstallTimeouts, ReplicaInstall
from lorafleet.protocol.agent import (
    AdapterState,
    AgentInfo,
    FileProgress,
    RelayAccept,
    UploadSession,
)
from lorafleet.protocol.manifest import FileEntry
from lorafleet.publisher._errors import is_not_found, reason
from lorafleet.publisher._plan import Plan, ProgressCallback
from lorafleet.publisher.result import ReplicaState, ReplicaTiming, Timeouts

__all__ = ["Agent", "ReplicaTxn"]


@dataclass
class Agent:
    """A long-lived agent connection; ``info`` is learnt once and never changes after."""

    url: str
    client: AsyncAgentClient
    info: AgentInfo | None = None

    @property
    def id(self) -> str:
        return self.info.replica_id if self.info else self.url

    async def discover(self) -> None:
        """Ask the agent who it is, once. Raises ``LorafleetError`` if it cannot answer."""
        if self.info is None:
            self.info = await self.client.info()


class ReplicaTxn:
    """One replica's steps in one publication: stage, load, roll back, activate, release."""

    def __init__(
        self,
        agent: Agent,
        plan: Plan,
        timeouts: Timeouts,
        on_progress: ProgressCallback | None = None,
    ) -> None:
        self.agent = agent
        self.plan = plan
        self.timeouts = timeouts
        self.on_progress = on_progress
        self.timing = ReplicaTiming(replica=agent.id, agent_url=agent.url)
        self.install = ReplicaInstall(
            agent.client,
            plan.name,
            plan.version,
            plan.bundle.manifest,
            InstallTimeouts(
                call_s=timeouts.commit, transfer_s=timeouts.upload, load_s=timeouts.load
            ),
        )
        """The steps themselves (``lorafleet.install``); this adds timing and roll-back."""
        self.rollback_pending = False
        """A rollback ran and could not undo everything here (``timing.rollback`` says what)."""

    @property
    def upload_id(self) -> str | None:
        """The upload session this publication opened and has not committed yet."""
        return self.install.upload_id

    @property
    def missing(self) -> list[str]:
        """The paths its open session still needs (the rest it holds already)."""
        return self.install.missing

    @property
    def touched(self) -> bool:
        """The agent may hold something of this publication (a session, a record, a load)."""
        return self.install.touched

    @property
    def load_attempted(self) -> bool:
        """A load of this publication's bytes was asked of the agent (it may reach the engine;
        the version number is then burnt, never handed out again)."""
        return self.install.load_attempted

    @property
    def id(self) -> str:
        return self.agent.id

    async def open(self, relay: RelayAccept | None = None) -> UploadSession:
        """Open (or re-open) this publication's upload session; ``relay``: peers may send."""
        session = await self.install.open(supersede=self.plan.supersede, relay=relay)
        self.timing.files_deduplicated = len(self.plan.bundle.files) - len(session.missing)
        return session

    async def send(self, entry: FileEntry, *, resume: bool = False) -> FileProgress:
        """Upload one file from the Publisher (``resume``: from the agent's durable offset).
        Counts the bytes that left the Publisher in ``timing.bytes_sent``."""
        assert self.upload_id is not None
        total = sum(self.plan.bundle.manifest.file(p).size for p in self.missing)

        def sent(n: int) -> None:
            self.timing.bytes_sent += n
            if self.on_progress:
                self.on_progress(self.id, self.timing.bytes_sent, total)

        prog = await self.install.send(
            entry, self.plan.bundle.source(entry.path), on_sent=sent, resume=resume
        )
        self.timing.files_sent += 1
        return prog

    async def commit(self) -> None:
        """Commit the open session: the agent verifies the whole bundle and stages it."""
        await self.install.commit()
        self.timing.state = ReplicaState.STAGED

    async def stage(self) -> None:
        """Get the bundle's files into the agent's store: upload what it lacks and commit, or
        register the shared path. Raises ``LorafleetError`` (the agent refused, or did not
        answer) or ``TimeoutError`` (a step outlived its ``Timeouts`` limit)."""
        bundle, timing = self.plan.bundle, self.timing
        t = time.perf_counter()
        if self.plan.transfer == "remote_upload":
            await self.open()
            timing.open_s = time.perf_counter() - t
            for path in self.missing:
                await self.send(bundle.manifest.file(path))
            timing.upload_s = time.perf_counter() - t
            t = time.perf_counter()
            await self.commit()
        else:
            await self.install.register(str(self.plan.shared_path), supersede=self.plan.supersede)
        timing.verify_s = time.perf_counter() - t
        timing.state = ReplicaState.STAGED

    async def load(self) -> None:
        """Load the staged version into the engine. Raises like ``stage``."""
        t = time.perf_counter()
        await self.install.load(self.plan.load_mode)
        self.timing.load_s = time.perf_counter() - t
        self.timing.state = ReplicaState.LOADED

    async def verify(self) -> None:
        """Have the agent check that its engine applies the loaded version, addressed as the
        router will address it, and that it answers the plan's canary as the trainer did.
        Raises ``AdapterNotApplied`` when it answers as the base model, ``CanaryMismatch``
        when it answers the canary otherwise, or like ``stage``."""
        t = time.perf_counter()
        try:
            rec = await self.install.prove(self.plan.canary)
        except CanaryMismatch:
            self.timing.canary = await self.install.canary_verdict()
            raise
        self.timing.probe_s = time.perf_counter() - t
        self.timing.application = rec.application
        self.timing.canary = rec.canary

    async def roll_back(self) -> str | None:
        """Undo this publication here: discard its staging and unload its version (only with its
        digest: another publisher's bytes are not ours to undo); in place, also unload every
        other version of the name. Returns None when nothing of it stays here, else what stays
        and why (also in ``timing.rollback``); raises nothing."""
        plan, client = self.plan, self.agent.client
        problems: list[str] = []
        if self.upload_id is None and self.touched and plan.transfer != "shared_filesystem":
            # The answer to our open may have been lost (cancelled or timed out in flight):
            # opening the same manifest again returns that session, if there is one.
            with contextlib.suppress(LorafleetError, TimeoutError):
                await self.install.open()
        if self.upload_id:
            try:
                await self.install.discard()
            except (LorafleetError, TimeoutError) as exc:
                if not is_not_found(exc):
                    problems.append(f"its staging could not be discarded ({reason(exc)})")
        if not self.touched and plan.mode != "in_place":
            return self._rolled_back(problems)
        try:
            held = await client.list_adapters()
        except LorafleetError as exc:
            problems.append(
                f"the agent could not be reached ({reason(exc)}): it may still hold "
                f"v{plan.version}, which the next publication of {plan.name!r} supersedes"
            )
            return self._rolled_back(problems)
        ours = (plan.name, plan.version, plan.bundle.digest)
        versions = [a.version for a in held if (a.name, a.version, a.digest) == ours]
        if plan.mode == "in_place":
            # Fail closed: the plain name must not keep serving anywhere.
            versions += [
                a.version
                for a in held
                if a.name == plan.name and a.mode == "in_place" and a.version != plan.version
            ]
        for v in versions:
            try:
                await client.unload(plan.name, v)
            except EngineUnavailable:
                problems.append(
                    f"v{v} stays on the agent (retiring) until its engine answers again; the "
                    "agent then unloads it and removes its files"
                )
            except LorafleetError as exc:
                if not is_not_found(exc):
                    problems.append(f"v{v} could not be unloaded ({reason(exc)})")
        return self._rolled_back(problems)

    def _rolled_back(self, problems: list[str]) -> str | None:
        if problems:
            self.timing.rollback = "; ".join(problems)
            self.rollback_pending = True
            if self.timing.state != ReplicaState.FAILED:
                self.timing.state = ReplicaState.ROLLBACK_PENDING
            return self.timing.rollback
        self.timing.rollback = "rolled back" if self.touched else "nothing to roll back"
        if self.timing.state != ReplicaState.FAILED:
            self.timing.state = ReplicaState.ROLLED_BACK
        return None

    async def activate(self) -> None:
        """Record the version as active on the agent. Raises ``LorafleetError``."""
        await self.install.activate()
        self.timing.state = ReplicaState.ACTIVE

    async def older_versions(self) -> list[int]:
        """The name's older versions this agent holds and does not serve as active.
        Raises ``LorafleetError`` if the agent cannot list them."""
        records = await self.agent.client.list_adapters()
        return [
            a.version
            for a in records
            if a.name == self.plan.name
            and a.version < self.plan.version
            and a.state != AdapterState.ACTIVE
        ]

    async def release(self, versions: Collection[int]) -> tuple[list[int], list[str]]:
        """Unload ``versions`` (drained at the router) here. Returns (released, warnings)."""
        released, warnings = [], []
        for v in versions:
            try:
                await self.agent.client.unload(self.plan.name, v)
                released.append(v)
            except LorafleetError as exc:
                if not is_not_found(exc):
                    warnings.append(f"{self.id}: release of v{v}: {reason(exc)}")
        return released, warnings
