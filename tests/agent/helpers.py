"""Helpers shared by the agent tests: auth headers, store snapshots, cut uploads, completions."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

from lorafleet.agent.spec import AgentSpec
from lorafleet.launch import Server
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


def put_cut(server: Server[AgentSpec], upload_id: str, path: str, data: bytes, cut_after: int):
    """Send a PUT declaring all of ``data`` but close the socket after ``cut_after`` bytes."""
    host, port = server.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    head = (
        f"PUT /v1/uploads/{upload_id}/files/{path} HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {server.spec.token}\r\nContent-Length: {len(data)}\r\n"
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    s.sendall(head + data[:cut_after])
    s.shutdown(socket.SHUT_RDWR)
    s.close()
