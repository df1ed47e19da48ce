"""Verified upload throughput through a real agent process over loopback.

The agent (``lorafleet agent``, its own process) receives a 1 GiB file from ``AsyncAgentClient``,
hashing and writing it as it arrives, fsyncing and renaming it into its blob store. The figure is
the ratio of that throughput to min(sha256, write+fsync) measured on this machine in the same
run: the most a verifying receiver could do. Target: >= 0.85 (median of the runs).

Beside it, CPU seconds per GiB: the agent's (user+sys of its process, psutil), the sender's (this
process), and sha256's alone over the same bytes (``process_time`` around the updates). The
agent's efficiency, sha256 CPU / agent CPU, does not depend on the sender sharing the machine.
The write+fsync limit goes through the page cache; the agent writes a large file with O_DIRECT,
which can be faster on a fast disk, so the ratio to sha256 alone is printed as well.

The sender's digest is part of its manifest, computed once when the bundle was built, so the timed
part is the upload alone (PUT until the verified answer).

Usage: python bench/upload_throughput.py [--mib 1024] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from _limits import make_file, manifest_for, sha256_rate, write_fsync_rate
from lorafleet.agent.spec import AgentSpec
from lorafleet.clients.agent import AsyncAgentClient
from lorafleet.launch import Launcher, ManagedProcess
from lorafleet.protocol.manifest import FileEntry

CHUNK = 1 << 20
MiB = 1 << 20


def limits(path: Path, size: int, scratch: Path) -> tuple[float, float]:
    """Bytes/s of sha256 over the (cached) source, and of write+fsync to the agent's disk."""
    return sha256_rate(path), write_fsync_rate(scratch, size)


def sha256_cpu(path: Path) -> float:
    """CPU seconds of sha256 over ``path`` in 1 MiB chunks (only the updates are timed)."""
    h = hashlib.sha256()
    buf = bytearray(MiB)
    cpu = 0.0
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            c = time.process_time()
            h.update(memoryview(buf)[:k])
            cpu += time.process_time() - c
    return cpu


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def start_agent(data_dir: Path, log: Path) -> tuple[ManagedProcess, str, str]:
    """An agent with no engine behind it: uploads do not need one (it reports not ready)."""
    spec = AgentSpec(
        engine="vllm",
        engine_url="http://127.0.0.1:9",
        data_dir=data_dir,
        token=secrets.token_urlsafe(16),
        extra=("--log-level", "warning"),
        ready_status=503,
        name=log.stem,
    )
    agent = Launcher(log.parent).start(spec)  # the caller stops agent.proc
    return agent.proc, agent.url, str(spec.token)


async def upload_once(url: str, token: str, src: Path, entry: FileEntry, version: int) -> float:
    """Seconds for one verified upload of ``src``; the session is discarded afterwards."""
    manifest = manifest_for(entry, "bench", version)
    async with AsyncAgentClient(url, token, timeout=600) as c:
        sess = await c.open_upload(manifest)
        t = time.perf_counter()
        prog = await c.upload_file(sess.upload_id, entry, src, chunk_size=4 * MiB)
        dt = time.perf_counter() - t
        assert prog.complete, prog
        await c.discard(sess.upload_id)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    size = args.mib * MiB
    with tempfile.TemporaryDirectory(
        prefix="lorafleet-bench-", dir=os.environ.get("BENCH_DIR")
    ) as td:
        root = Path(td)
        src = root / "source.bin"
        entry = make_file(src, args.mib)
        proc, url, token = start_agent(root / "agent", root / "agent.log")
        agent = psutil.Process(proc.pid)
        gib = size / (1 << 30)
        ratios, rates, effs, vs_sha = [], [], [], []
        try:
            for i in range(args.runs):
                sha, wr = limits(src, size, root)
                limit = min(sha, wr)
                sha_cpu = sha256_cpu(src) / gib
                a0, s0 = cpu_s(agent), time.process_time()
                dt = asyncio.run(upload_once(url, token, src, entry, i + 1))
                agent_cpu = (cpu_s(agent) - a0) / gib
                sender_cpu = (time.process_time() - s0) / gib
                rate = size / dt
                rates.append(rate)
                ratios.append(rate / limit)
                effs.append(sha_cpu / agent_cpu)
                vs_sha.append(rate / sha)
                print(
                    f"run {i + 1}: sha256 {sha / MiB:.0f} MiB/s, write+fsync {wr / MiB:.0f} MiB/s, "
                    f"upload {rate / MiB:.0f} MiB/s ({dt:.2f} s) -> ratio {rate / limit:.2f} "
                    f"(÷ sha256 alone {rate / sha:.2f}); "
                    f"CPU s/GiB agent {agent_cpu:.2f}, sender {sender_cpu:.2f}, "
                    f"sha256 {sha_cpu:.2f} -> efficiency {sha_cpu / agent_cpu:.2f}; "
                    f"load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
        finally:
            proc.stop()
    med = statistics.median(rates) / MiB
    print(
        f"median over {args.runs} runs of {args.mib} MiB: upload {med:.0f} MiB/s, "
        f"ratio {statistics.median(ratios):.2f} (target >= 0.85), "
        f"÷ sha256 alone {statistics.median(vs_sha):.2f}, "
        f"agent CPU efficiency {statistics.median(effs):.2f}"
    )
    sys.exit(0)


if __name__ == "__main__":
    main()
