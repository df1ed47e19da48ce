"""The agent's peak resident memory growth while it receives one large verified upload.

Reads VmHWM (peak RSS) from /proc/<agent pid>/status after a warm-up upload and again after the
measured one; the difference is what the upload cost in memory. A fresh agent per size, since
VmHWM only grows. Target: growth <= 64 MiB for both sizes (bounded buffers, streaming to disk).

Usage: python bench/upload_rss.py [--sizes-mib 64,4096]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

from upload_throughput import MiB, make_file, start_agent, upload_once


def vm_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", default="64,4096")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    worst = 0
    with tempfile.TemporaryDirectory(
        prefix="lorafleet-rss-", dir=os.environ.get("BENCH_DIR")
    ) as td:
        root = Path(td)
        warm_src = root / "warm.bin"
        warm = make_file(warm_src, 1)
        for mib in sizes:
            src = root / f"src-{mib}.bin"
            entry = make_file(src, mib)
            proc, url, token = start_agent(root / f"agent-{mib}", root / f"agent-{mib}.log")
            try:
                asyncio.run(upload_once(url, token, warm_src, warm, 1))  # imports, pools, buffers
                before = vm_hwm(proc.pid)
                dt = asyncio.run(upload_once(url, token, src, entry, 2))
                after = vm_hwm(proc.pid)
            finally:
                proc.stop()
            src.unlink()
            growth = after - before
            worst = max(worst, growth)
            print(
                f"{mib} MiB upload ({dt:.1f} s): agent VmHWM {before / MiB:.1f} -> "
                f"{after / MiB:.1f} MiB, growth {growth / MiB:.1f} MiB",
                flush=True,
            )
    print(f"worst peak RSS growth {worst / MiB:.1f} MiB (target <= 64 MiB)")


if __name__ == "__main__":
    main()
