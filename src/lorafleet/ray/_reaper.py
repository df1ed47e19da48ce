"""``python .../lorafleet/ray/_reaper.py WATCH_PID PGID``: SIGKILL process group PGID once
WATCH_PID is gone.

A server an actor launched runs in its own session (``lorafleet.launch``), so it outlives an actor
that Ray kills with SIGKILL. This watchdog, started beside it in yet another session, ends it
then: a restarted actor finds its port and data directory free, and nothing is left orphaned on
the node. It exits by itself when the group is gone first (a clean stop).

It detaches (forks and lets its first process exit) so that it is not a child of the actor's
worker: a Ray worker that exits kills its direct children, which would take the watchdog with
the server's leader and leave the rest of the group running (vLLM's ``EngineCore``, holding the
model's memory).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

POLL_S = 0.2


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str]) -> int:
    watch_pid, pgid = int(argv[0]), int(argv[1])
    if os.fork():
        return 0  # the caller reaps this first process at once; the watch goes on in the child
    while _group_exists(pgid):
        if not _exists(watch_pid) or _is_zombie(watch_pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            return 0
        time.sleep(POLL_S)
    return 0


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
