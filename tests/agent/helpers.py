"""Helpers shared by the agent tests: auth headers, store snapshots, greedy completions."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from lorafleet.launch import AgentSpec, Server
from lorafleet.testing import greedy_completion


def auth(server: Server[AgentSpec]) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.spec.token}"}


def snapshot(data_dir: Path) -> dict:
    """What the store holds: blob and adapter files (path -> size, sha256), staging bytes."""
    out: dict = {"staging_bytes": 0, "files": {}}
    for sub in ("blobs", "adapters"):
        root = data_dir / sub
        for dirpath, _, files in os.walk(root):
            for f in files:
                p = Path(dirpath) / f
                out["files"][str(p.relative_to(data_dir))] = (
                    p.stat().st_size,
                    hashlib.sha256(p.read_bytes()).hexdigest(),
                )
    for dirpath, _, files in os.walk(data_dir / "staging"):
        for f in files:
            out["staging_bytes"] += (Path(dirpath) / f).stat().st_size
    return out


def completion(url: str, model: str, prompt: str = "The quick brown fox") -> list[int]:
    status, ids, body = greedy_completion(url, model, prompt, 8)
    assert status == 200, body
    return ids
