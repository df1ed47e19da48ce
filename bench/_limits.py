"""The machine's own limits, measured in the same run as a benchmark's figures."""

from __future__ import annotations

import os
import time
from pathlib import Path

CHUNK = 1 << 20


def write_fsync_rate(scratch: Path, size: int) -> float:
    """Bytes/s of writing ``size`` bytes to ``scratch``'s disk and fsyncing them once."""
    buf = os.urandom(CHUNK)
    out = scratch / "write-limit"
    t = time.perf_counter()
    with open(out, "wb") as dst:
        for _ in range(size // CHUNK):
            dst.write(buf)
        dst.flush()
        os.fsync(dst.fileno())
    rate = size / (time.perf_counter() - t)
    out.unlink()
    return rate
