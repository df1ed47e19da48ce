"""Test doubles that run as their own processes: servers with a deliberate fault.

They are not part of the runtime package; each runs as ``python -m tests.doubles.<name>`` from the
checkout root (``spawn_env`` puts it on the path) with the real server's options.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]


def spawn_env() -> dict[str, str]:
    """The environment a double's process needs to import ``tests.doubles`` (the checkout root
    ahead of this process's own ``PYTHONPATH``, which may carry the ``src`` under test)."""
    inherited = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(CHECKOUT), inherited) if p)}


def module_argv(module: str, argv: list[str], command: str) -> list[str]:
    """``argv`` of ``lorafleet COMMAND ...`` rewritten to run ``python -m module ...``."""
    prefix = [sys.executable, "-m", "lorafleet", command]
    assert argv[: len(prefix)] == prefix, argv
    return [sys.executable, "-m", module, *argv[len(prefix) :]]
