"""Registration by reference: adapters the router knows by a directory, loaded only where placed.

A registration names a PEFT directory the agents may read (under their ``--shared-fs-allow``)
and the router may read (under its ``--source-allow`` or ``--watch-dir``). The router reads it
once: its manifest (each file's size and SHA-256) and digest, and the bundle's checks. The name
then has a routable version held by no replica (cold, placed nowhere); the first request for it
has the placer load it on one replica, where the agent copies the files into its store,
verifying each against that manifest, as for any upload (``ReplicaInstall.registered``). Bytes
changed after registration are refused there, never served.

A watched directory (``--watch-dir``, what SkyRL's Tinker server extracts its sampler
checkpoints into) registers each subdirectory under its own name: on a scan every few seconds,
and at once when a request names one the router does not know yet (the request that follows an
extraction must not wait for the scan). Registering the same bytes again changes nothing;
changed bytes are the name's next version.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lorafleet._atomic import atomic_write
from lorafleet.bundle import AdapterBundle
from lorafleet.bundle.validate import BIN, SAFETENSORS
from lorafleet.errors import AdapterInvalid, BundleError, PathNotAllowed, TenantQuotaExceeded
from lorafleet.protocol.agent import engine_name
from lorafleet.protocol.manifest import ADAPTER_CONFIG, Manifest
from lorafleet.protocol.names import is_valid_name
from lorafleet.protocol.router import RegisterResult
from lorafleet.protocol.tenants import Tenants
from lorafleet.router.copies import Copies
from lorafleet.router.table import AliasStore

__all__ = ["Reference", "Sources"]

log = logging.getLogger("lorafleet.router.sources")

REFERENCES_FILE = "references.json"
HOLDER = "lorafleet-registry"
"""The lease holder registrations reserve version numbers as."""


@dataclass(frozen=True)
class Reference:
    """Where a registered version's bytes are, and what they must be."""

    path: str
    manifest: Manifest


class Sources:
    """Registrations and watched directories (see the module docstring)."""

    def __init__(
        self,
        store: AliasStore,
        copies: Copies,
        *,
        allow: list[str] | None = None,
        watch: list[str] | None = None,
        state_dir: str | os.PathLike | None = None,
        scan_interval_s: float = 2.0,
        tenants: Tenants | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.tenants = tenants
        self.copies = copies
        self.watch = [Path(p).resolve() for p in watch or []]
        self.allow = [*self.watch, *(Path(p).resolve() for p in allow or [])]
        self.scan_interval_s = scan_interval_s
        self.on_change = on_change
        self.refs: dict[tuple[str, int], Reference] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._seen: dict[Path, tuple] = {}
        """A watched subdirectory -> its files' (name, size, mtime) when last looked at."""
        self._task: asyncio.Task | None = None
        self.path = Path(state_dir) / REFERENCES_FILE if state_dir else None
        if self.path is not None and self.path.exists():
            raw = json.loads(self.path.read_text())
            for item in raw:
                m = Manifest.model_validate(item["manifest"])
                self.refs[(m.name, m.version)] = Reference(item["path"], m)

    # --- reads ---------------------------------------------------------------------------------

    def reference(self, name: str, version: int) -> Reference | None:
        """The registered source of ``version`` of ``name``, if it was registered by reference."""
        return self.refs.get((name, version))

    # --- registration --------------------------------------------------------------------------

    def _confined(self, path: str) -> Path:
        src = Path(path).resolve()
        if not any(src == a or a in src.parents for a in self.allow):
            raise PathNotAllowed(
                f"{path!r} is outside the directories this router may register from "
                "(--source-allow, --watch-dir)",
                param="path",
            )
        return src

    async def register(self, name: str, path: str, keep_versions: int = 2) -> RegisterResult:
        """Register the PEFT directory ``path`` as ``name``'s next version (the same bytes as
        its newest version: nothing changes). Raises ``PathNotAllowed``, ``AdapterInvalid``
        (not a valid adapter directory), ``PublishInProgress`` (a publication holds the name),
        ``TenantQuotaExceeded`` (the tenant whose name it is would go past its adapters or
        bytes; nothing is registered)."""
        src = self._confined(path)
        async with self._locks.setdefault(name, asyncio.Lock()):
            bundle = await asyncio.to_thread(_read_bundle, src, name)
            entry = self.store.aliases.get(name)
            if entry is not None:
                newest = entry.window()[0]
                ref = self.refs.get((name, newest.version))
                if ref is not None and _same_bytes(ref.manifest, bundle.manifest):
                    return RegisterResult(
                        name=name,
                        version=newest.version,
                        digest=ref.manifest.digest,
                        size=ref.manifest.total_size,
                        created=False,
                    )
            owner = self.tenants.owner(name) if self.tenants is not None else None
            if owner is not None:
                owner.check_quota(self.store.aliases, name, bundle.total_size)
            v = self.store.reserve(name, HOLDER)
            manifest = bundle.with_version(v).manifest
            self.refs[(name, v)] = Reference(str(src), manifest)
            self._persist()
            self.store.set_alias(
                name,
                v,
                engine_name(name, v),
                [],
                lease_holder=HOLDER if self.store.lease_of(name) is not None else None,
                keep_versions=max(keep_versions, entry.keep_versions if entry else 1),
                digest=manifest.digest,
                placement=[],
                size=manifest.total_size,
            )
            self.prune()
            if self.on_change is not None:
                self.on_change()
            await self.copies.wait_acked(self.copies.seq)
            log.info("registered %s v%d from %s (%d bytes)", name, v, src, manifest.total_size)
            return RegisterResult(
                name=name, version=v, digest=manifest.digest, size=manifest.total_size
            )

    async def resolve(self, name: str) -> bool:
        """Whether ``name`` is in the table, registering it from a watched directory first if
        one holds a subdirectory of that name. Never raises for a name it cannot find."""
        if name in self.store.aliases:
            return True
        if not self.watch or not is_valid_name(name):
            return False
        for root in self.watch:
            d = root / name
            if _looks_complete(d):
                try:
                    await self.register(name, str(d))
                except (AdapterInvalid, PathNotAllowed, TenantQuotaExceeded) as exc:
                    log.warning("cannot register %s from %s: %s", name, d, exc)
                    return False
                return True
        return False

    def prune(self) -> None:
        """Forget references to versions no longer routable (their record, not their files)."""
        live = {(n, v.version) for n, e in self.store.aliases.items() for v in e.window()}
        gone = [k for k in self.refs if k not in live]
        for k in gone:
            del self.refs[k]
        if gone:
            self._persist()

    def _persist(self) -> None:
        if self.path is None:
            return
        doc = [
            {"path": r.path, "manifest": r.manifest.model_dump(mode="json")}
            for r in self.refs.values()
        ]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps(doc, separators=(",", ":")).encode())

    # --- watching ------------------------------------------------------------------------------

    def start(self) -> None:
        if self.watch and self._task is None:
            self._task = asyncio.create_task(self._scan_loop(), name="watch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _scan_loop(self) -> None:
        while True:
            try:
                await self.scan()
            except Exception:  # a scan that failed is tried again at the next tick
                log.exception("scanning the watched directories failed")
            await asyncio.sleep(self.scan_interval_s)

    async def scan(self) -> list[str]:
        """Register every watched subdirectory that is new or changed; the names registered."""
        done: list[str] = []
        for root in self.watch:
            try:
                entries = sorted(root.iterdir())
            except OSError:
                continue
            for d in entries:
                if not is_valid_name(d.name) or not _looks_complete(d):
                    continue
                sig = _signature(d)
                if sig is None or self._seen.get(d) == sig:
                    continue
                self._seen[d] = sig
                try:
                    got = await self.register(d.name, str(d))
                except (AdapterInvalid, PathNotAllowed, TenantQuotaExceeded) as exc:
                    log.warning("not registering %s: %s", d, exc)
                    continue
                except Exception as exc:  # held by a publication now: try again next time
                    log.info("not registering %s now: %s", d, exc)
                    self._seen.pop(d, None)
                    continue
                if got.created:
                    done.append(d.name)
        return done


def _read_bundle(src: Path, name: str) -> AdapterBundle:
    """The bundle of ``src``, hashed once and checked as any publication is. Raises
    ``AdapterInvalid``."""
    try:
        bundle = AdapterBundle.from_dir(src, name=name, version=1)
    except (BundleError, OSError) as exc:
        raise AdapterInvalid([str(exc)], str(src)) from exc
    bundle.validate().raise_for_problems(str(src))
    return bundle


def _same_bytes(a: Manifest, b: Manifest) -> bool:
    key = lambda m: sorted((f.path, f.size, f.sha256) for f in m.files)  # noqa: E731
    return key(a) == key(b) and a.config == b.config


def _looks_complete(d: Path) -> bool:
    """A PEFT directory whose weights are all there (a writer that does not rename into place
    may still be writing: the safetensors header says how long the file must be)."""
    if d.name.startswith(".") or not (d / ADAPTER_CONFIG).is_file():
        return False
    weights = d / SAFETENSORS
    if not weights.is_file():
        return (d / BIN).is_file()
    try:
        with weights.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return False
            n = int.from_bytes(head, "little")
            header = json.loads(f.read(n))
        end = max(
            (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
        )
        return weights.stat().st_size >= 8 + n + end
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False


def _signature(d: Path) -> tuple | None:
    try:
        return tuple(
            (p.name, st.st_size, st.st_mtime_ns)
            for p in sorted(d.iterdir())
            if p.is_file() and (st := p.stat())
        )
    except OSError:
        return None
