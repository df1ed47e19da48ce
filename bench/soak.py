"""Soak: many atomic publications at RL cadence under light routed load; does anything grow?

Fleet (real processes on loopback): 2 reference-engine replicas (engine + agent each) behind one
router with a state directory. One ``Publisher`` publishes a small adapter (r=8 on q/k/v/o,
~60 KB, new weights every time) every ``--interval`` seconds (the next one starts at once when a
publication took longer), ``--count`` times. A background thread sends one routed completion
every ~0.2 s and counts failures and versions.

Recorded at the start, at ``--points`` points in between and at the end: publish latency (p50 and
p99 per segment), RSS and open file descriptors (``/proc/<pid>/fd``) of each agent, the router
and each engine, disk use of each agent's data directory (blobs, adapter directories, staging)
and of the router's state directory, and each agent's SQLite size (``state.db`` + WAL). Printed
at the end: end/start ratios, and "flat" when a ratio stays under ``--flat`` (default 1.25;
RSS and disk also pass within 4 MiB / 256 KiB of the start, where allocator noise dominates).

The machine's limit, measured in the same run (before and after): sha256 throughput and the
latency of one durable write of an adapter-sized file (write + fsync + rename + directory
fsync, what each replica does per file at least). The publish p50 is then quoted as a multiple of
that durable-write latency.

Usage: python bench/soak.py [--count 1000] [--interval 0.5] [--points 4]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import secrets
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from lorafleet.launch import Launcher, Server
from lorafleet.publisher import Publisher
from lorafleet.publisher.result import Timeouts
from lorafleet.testing import make_peft_model, start_agent, start_reference_engine, start_router
from lorafleet.tinymodel import ensure_tiny_model

MiB = 1 << 20
NAME = "soak"


# -- the machine's own limit -----------------------------------------------------------------------


def machine_limit(work: Path, size: int, n: int = 50) -> tuple[float, float]:
    """(sha256 MiB/s over 64 MiB, p50 seconds of one durable write of ``size`` bytes)."""
    data = os.urandom(64 * MiB)
    t = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    sha = 64 / (time.perf_counter() - t)
    blob = os.urandom(size)
    d = work / "fsync-probe"
    d.mkdir(exist_ok=True)
    times = []
    for i in range(n):
        t = time.perf_counter()
        tmp, final = d / f"{i}.partial", d / f"{i}"
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
        dfd = os.open(d, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
        times.append(time.perf_counter() - t)
        final.unlink()
    return sha, statistics.median(times)


# -- what is sampled ----------------------------------------------------------------------------


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def tree_bytes(root: Path) -> int:
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(d, f)).st_size
    return total


def sqlite_bytes(data_dir: Path) -> int:
    return sum(
        (data_dir / n).stat().st_size
        for n in ("state.db", "state.db-wal", "state.db-shm")
        if (data_dir / n).exists()
    )


def sample(procs: dict[str, Server], agents: list[Server], router_dir: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for label, s in procs.items():
        out[f"{label} rss"] = rss(s.pid)
        out[f"{label} fds"] = fds(s.pid)
    for i, a in enumerate(agents):
        out[f"agent{i} disk"] = tree_bytes(a.spec.data_dir)
        out[f"agent{i} sqlite"] = sqlite_bytes(a.spec.data_dir)
    out["router state"] = tree_bytes(router_dir)
    return out


# -- load ------------------------------------------------------------------------------------------


class Load(threading.Thread):
    """One routed completion every ~0.2 s; counts statuses and versions."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.ok = 0
        self.failed: list[str] = []

    def run(self) -> None:
        body = {"model": NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0}
        with httpx.Client(timeout=60) as c:
            while not self.stop.wait(0.2):
                try:
                    r = c.post(self.url + "/v1/completions", json=body)
                    if r.status_code == 200:
                        self.ok += 1
                    else:
                        self.failed.append(f"{r.status_code} {r.text[:200]}")
                except httpx.HTTPError as exc:
                    self.failed.append(f"{type(exc).__name__}: {exc}")


# -- the run ---------------------------------------------------------------------------------------


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def fmt(key: str, v: float) -> str:
    if key.endswith("fds"):
        return f"{v:.0f}"
    return f"{v / MiB:.2f} MiB" if v >= 64 * 1024 else f"{v / 1024:.1f} KiB"


def new_weights(model, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def run(count: int, interval: float, points: int, flat: float, work: Path) -> int:
    model_dir = ensure_tiny_model()
    launcher = Launcher(work / "logs")
    try:
        engines = [start_reference_engine(launcher, model_dir) for _ in range(2)]
        token = secrets.token_urlsafe(12)
        agents = [
            start_agent(launcher, e, work / f"agent{i}", token=token) for i, e in enumerate(engines)
        ]
        router_dir = work / "router"
        router = start_router(launcher, agents, router_dir, token=token, health_interval=0.5)
        procs = {
            **{f"agent{i}": a for i, a in enumerate(agents)},
            "router": router,
            **{f"engine{i}": e for i, e in enumerate(engines)},
        }
        model = make_peft_model(model_dir, r=8, seed=1)
        probe_file = work / "probe-adapter"
        model.save_pretrained(str(probe_file))
        size = (probe_file / "adapter_model.safetensors").stat().st_size
        sha0, fsync0 = machine_limit(work, size)
        print(
            f"machine limit (start): sha256 {sha0:.0f} MiB/s; durable write of {size / 1024:.0f}"
            f" KiB (write+fsync+rename+dir fsync) p50 {fsync0 * 1e3:.2f} ms"
        )
        load = Load(router.url)
        lat: list[float] = []
        lags = 0
        samples: list[tuple[int, dict[str, int]]] = []
        at = {0, count} | {round(count * k / (points + 1)) for k in range(1, points + 1)}
        timeouts = Timeouts(drain=10)
        with Publisher([a.url for a in agents], router=router.url, token=token,
                       timeouts=timeouts) as pub:  # fmt: skip
            new_weights(model, 0)
            pub.publish(model, name=NAME)  # v1 before the load starts: the name exists
            load.start()
            t_begin = time.perf_counter()
            next_start = time.perf_counter()
            for i in range(count + 1):
                if i in at:
                    samples.append((i, sample(procs, agents, router_dir)))
                if i == count:
                    break
                now = time.perf_counter()
                if now < next_start:
                    time.sleep(next_start - now)
                else:
                    lags += i > 0
                next_start = max(now, next_start) + interval
                new_weights(model, i + 1)
                t = time.perf_counter()
                pub.publish(model, name=NAME)
                lat.append(time.perf_counter() - t)
                if (i + 1) % 100 == 0:
                    print(f"  {i + 1} publications, {time.perf_counter() - t_begin:.0f}s")
            wall = time.perf_counter() - t_begin
        load.stop.set()
        load.join(60)
        sha1, fsync1 = machine_limit(work, size)
        print(
            f"machine limit (end): sha256 {sha1:.0f} MiB/s; durable write p50 {fsync1 * 1e3:.2f} ms"
        )

        print(
            f"\n{count} publications in {wall:.0f}s (interval {interval}s; {lags} started late "
            f"because the one before took longer); load: {load.ok} ok, {len(load.failed)} failed"
        )
        for f in load.failed[:5]:
            print(f"  failed: {f}")
        seg = max(1, count // (points + 1))
        chunks = [lat[k : k + seg] for k in range(0, len(lat), seg)]
        print("publish latency per segment of", seg, "(p50 / p99 ms):")
        print("  " + " | ".join(f"{percentile(c, .5) * 1e3:.0f} / {percentile(c, .99) * 1e3:.0f}"
                                for c in chunks))  # fmt: skip
        p50, p99 = percentile(lat, 0.5), percentile(lat, 0.99)
        fs = statistics.median([fsync0, fsync1])
        print(
            f"publish latency over all: p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms "
            f"(p50 = {p50 / fs:.0f}x one durable write of the adapter, median {fs * 1e3:.2f} ms)"
        )
        head = " | ".join(f"@{i}" for i, _ in samples)
        print(f"\n{'metric':<16} {head} | end/start | flat?")
        growing = []
        for key in samples[0][1]:
            vals = [s[key] for _, s in samples]
            start, end = vals[0], vals[-1]
            ratio = end / start if start else float("inf") if end else 1.0
            slack = 4 * MiB if key.endswith("rss") else 256 * 1024 if "fds" not in key else 0
            ok = ratio <= flat or end - start <= slack
            if not ok:
                growing.append(key)
            row = " | ".join(fmt(key, v) for v in vals)
            print(f"{key:<16} {row} | {ratio:.2f} | {'flat' if ok else 'GROWS'}")
        first, last = chunks[0], chunks[-1]
        lat_ratio = percentile(last, 0.5) / percentile(first, 0.5)
        print(f"publish p50 last segment / first segment: {lat_ratio:.2f}")
        if lat_ratio > flat:
            growing.append("publish latency")
        print("\nflat: all" if not growing else f"\nGROWS: {', '.join(growing)}")
        return 1 if growing else 0
    finally:
        launcher.stop_all()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--points", type=int, default=4, help="samples between start and end")
    ap.add_argument("--flat", type=float, default=1.25, help="end/start ratio still flat")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="lf-soak-") as tmp:
        raise SystemExit(run(a.count, a.interval, a.points, a.flat, Path(tmp)))


if __name__ == "__main__":
    main()
