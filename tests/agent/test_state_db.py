"""The agent's state DB stays small however many publications pass through it.

bench/soak.py found ``state.db-wal`` growing by ~50 KiB per publication (SQLite checkpoints
every 1,000 pages and never truncates the log by default): ~4 MiB for a table of a few rows.
"""

from __future__ import annotations

import hashlib

from lorafleet.agent.state import WAL_BYTES, StateDB, StoredAdapter
from lorafleet.protocol.agent import AdapterRecord, AdapterState
from lorafleet.protocol.manifest import FileEntry, Manifest


def _item(version: int, state: AdapterState) -> StoredAdapter:
    files = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"w" * version}
    m = Manifest(
        name="policy",
        version=version,
        config={"r": 8},
        files=tuple(
            FileEntry(path=p, size=len(b), sha256=hashlib.sha256(b).hexdigest())
            for p, b in files.items()
        ),
    )
    rec = AdapterRecord(
        name="policy",
        version=version,
        digest=m.digest,
        engine_name=f"policy@v{version}",
        mode="versioned",
        state=state,
        path=f"/data/adapters/policy/{version}",
    )
    return StoredAdapter(rec, m)


def test_the_write_ahead_log_stays_bounded_over_many_publications(tmp_path):
    db = StateDB(tmp_path / "state.db")
    sizes = []
    for v in range(1, 301):  # one publication's writes: stage, load, verify, activate, retire
        for state in (AdapterState.STAGED, AdapterState.LOADED, AdapterState.LOADED):
            db.put(_item(v, state))
        if v > 1:
            db.put(_item(v - 1, AdapterState.LOADED))
        db.put(_item(v, AdapterState.ACTIVE))
        if v > 1:
            db.delete("policy", v - 1)
        wal = tmp_path / "state.db-wal"
        sizes.append(wal.stat().st_size if wal.exists() else 0)
    assert [(i.record.version, i.record.state) for i in db.all()] == [(300, AdapterState.ACTIVE)]
    db.close()
    # Before: 300 publications left a WAL of ~4 MiB (and it only grew until then).
    assert max(sizes[50:]) <= WAL_BYTES + 64 * 1024, max(sizes)
    reopened = StateDB(tmp_path / "state.db")
    assert [i.record.version for i in reopened.all()] == [300]
    reopened.close()
