"""Durable desired state: one row per adapter version in ``<data_dir>/state.db`` (sqlite3).

The engine forgets everything when it restarts; this table is what the reconciler reinstalls.
Writes are small and rare, so they run inline with ``synchronous=FULL``.

The write-ahead log is checkpointed every ``WAL_PAGES`` pages and cut back to ``WAL_BYTES``
afterwards. SQLite's defaults (1,000 pages, never truncated) let ``state.db-wal`` grow by
~50 KiB per publication to ~4 MiB and stay there, on a table that holds a few rows: found by
bench/soak.py at RL cadence.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from lorafleet.protocol.agent import AdapterRecord, AdapterState
from lorafleet.protocol.canary import Canary, CanaryVerdict
from lorafleet.protocol.manifest import Manifest

__all__ = ["StateDB", "StoredAdapter"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS adapters (
    name TEXT NOT NULL,
    version INTEGER NOT NULL,
    digest TEXT NOT NULL,
    engine_name TEXT NOT NULL,
    mode TEXT NOT NULL,
    state TEXT NOT NULL,
    path TEXT NOT NULL,
    error TEXT,
    manifest TEXT NOT NULL,
    application TEXT NOT NULL DEFAULT 'unchecked',
    delta_bound REAL,
    canary TEXT,
    PRIMARY KEY (name, version)
)
"""
# The trainer's canary a version was proven with, for catch-ups to prove a peer's copy by it.
_CANARIES = """
CREATE TABLE IF NOT EXISTS canaries (
    name TEXT NOT NULL,
    version INTEGER NOT NULL,
    canary TEXT NOT NULL,
    PRIMARY KEY (name, version)
)
"""
# Columns added after the first release, for state.db files an older agent wrote.
_ADDED = {
    "application": "TEXT NOT NULL DEFAULT 'unchecked'",
    "delta_bound": "REAL",
    "canary": "TEXT",
}
WAL_PAGES = 32
"""Checkpoint the write-ahead log once it holds this many pages (4 KiB each)."""
WAL_BYTES = 128 * 1024
"""What a checkpointed write-ahead log file is truncated to."""


class StoredAdapter:
    """A record plus the manifest it was committed from (for rank checks and blob GC)."""

    def __init__(self, record: AdapterRecord, manifest: Manifest) -> None:
        self.record = record
        self.manifest = manifest

    @property
    def shas(self) -> list[str]:
        return [f.sha256 for f in self.manifest.files]


class StateDB:
    def __init__(self, path: str | Path) -> None:
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(f"PRAGMA wal_autocheckpoint={WAL_PAGES}")
        self._db.execute(f"PRAGMA journal_size_limit={WAL_BYTES}")
        self._db.execute(_SCHEMA)
        self._db.execute(_CANARIES)
        have = {row[1] for row in self._db.execute("PRAGMA table_info(adapters)")}
        for column, decl in _ADDED.items():
            if column not in have:
                self._db.execute(f"ALTER TABLE adapters ADD COLUMN {column} {decl}")

    def close(self) -> None:
        self._db.close()

    def put(self, item: StoredAdapter) -> None:
        r = item.record
        self._db.execute(
            "INSERT OR REPLACE INTO adapters (name, version, digest, engine_name, mode, state, "
            "path, error, manifest, application, delta_bound, canary) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                r.name,
                r.version,
                r.digest,
                r.engine_name,
                r.mode,
                r.state.value,
                r.path,
                r.error,
                item.manifest.model_dump_json(),
                r.application,
                r.delta_bound,
                r.canary.model_dump_json() if r.canary is not None else None,
            ),
        )

    def delete(self, name: str, version: int) -> None:
        self._db.execute("DELETE FROM adapters WHERE name=? AND version=?", (name, version))
        self._db.execute("DELETE FROM canaries WHERE name=? AND version=?", (name, version))

    def put_canary(self, name: str, version: int, canary: Canary) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO canaries (name, version, canary) VALUES (?,?,?)",
            (name, version, canary.model_dump_json()),
        )

    def canary(self, name: str, version: int) -> Canary | None:
        row = self._db.execute(
            "SELECT canary FROM canaries WHERE name=? AND version=?", (name, version)
        ).fetchone()
        return Canary.model_validate_json(row[0]) if row else None

    def get(self, name: str, version: int) -> StoredAdapter | None:
        rows = self._select("WHERE name=? AND version=?", (name, version))
        return rows[0] if rows else None

    def by_name(self, name: str) -> list[StoredAdapter]:
        return self._select("WHERE name=? ORDER BY version", (name,))

    def all(self) -> list[StoredAdapter]:
        return self._select("ORDER BY name, version", ())

    def _select(self, where: str, args: tuple) -> list[StoredAdapter]:
        cur = self._db.execute(
            "SELECT name, version, digest, engine_name, mode, state, path, error, manifest, "
            f"application, delta_bound, canary FROM adapters {where}",
            args,
        )
        out = []
        for row in cur.fetchall():
            name, version, digest, ename, mode, state, path, error, manifest, app, bound, can = row
            rec = AdapterRecord(
                name=name,
                version=version,
                digest=digest,
                engine_name=ename,
                mode=mode,
                state=AdapterState(state),
                path=path,
                error=error,
                application=app,
                delta_bound=bound,
                canary=CanaryVerdict.model_validate_json(can) if can else None,
            )
            out.append(StoredAdapter(rec, Manifest.model_validate_json(manifest)))
        return out
