"""What /proc says about the processes a test started (Linux only)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


def _stats() -> Iterator[tuple[int, list[str], Path]]:
    """Each process's pid, the fields of its stat after the name (state, ppid, pgrp, ...),
    and its /proc folder; a process gone under the walk is skipped."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        yield int(entry.name), fields, entry


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid``."""
    return [p for p, fields, _ in _stats() if int(fields[1]) == pid]


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    return [p for p, fields, _ in _stats() if int(fields[2]) == pgid and fields[0] != "Z"]


def reapers(server_pid: int) -> list[int]:
    """The ``lorafleet.ray._reaper`` watchdogs that guard ``server_pid``."""
    out = []
    for pid, _, entry in _stats():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"_reaper.py") for a in argv) and str(server_pid).encode() in argv:
            out.append(pid)
    return out
