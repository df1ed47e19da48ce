"""The relay transfer against the star, beside this machine's own limits measured in the same run.

Three parts (``--parts``, default all three):

``shaped`` (needs root and network namespaces; skipped with the reason otherwise): a
``lorafleet.testing.netbed.NetBed`` with ``--replicas`` (8) replica hosts and a trainer host, every
host's egress shaped to ``--rate`` (400mbit). Each replica runs a reference engine and an agent
(max LoRA rank ``--rank``); the trainer runs one router per fleet size N in 1, 2, 4, 8 (over the
first N agents) and one Publisher process (``ip netns exec``). The adapter is a real PEFT adapter
on the tiny model, all-linear LoRA at rank ``--rank`` (4096 * r fp32 parameters: r=4096 is 64
MiB), with new bytes for every publication (agents deduplicate by content). Three arms, each run
interleaved: **tree** (the relay with the fan-out the Publisher plans, told the bed's link rate;
``protocol/relay.py``), **chain** (the relay with fan-out 1) and **star** (``remote_upload``: one
copy from the trainer to each replica). Recorded per publication: ``duration_s`` and its parts
(the slowest replica's upload, commit, load and probe), ``bytes_sent``, the trainer's egress
(``tx_bytes`` of its link around the call) and the CPU seconds of the bed's agents and engines.
The bed's own limit, each run: a raw TCP transfer of the adapter's size trainer -> r1 (plain
sockets), and a raw chain over every replica whose hops forward as they read. From the medians:
t(N)/t(1) per arm against the pooled N=1 median (every arm is the same direct upload there), the
per-hop time h from the chain's uploads, and the model's time at 16 to 4,096 replicas
(``protocol/relay.relay_time`` with the planned fan-out, against a chain).

``loopback``: 4 engine-less agents on 127.0.0.1 and a ``--mib`` (1024) random file. star = one
``upload_file`` to each agent at once from this process; relay = every session opened with a
``RelayAccept``, agents 0..2 told to forward to the next (``set_forward``), one ``upload_file`` to
agent 0, answered once the whole chain verified (3 ok hops, asserted). Sessions are opened before
and discarded after the timed part. Limits, each run: sha256 and write+fsync throughput, and the
floor for 4 verified copies on this machine, max(4 S / write+fsync, 4 S / (cores * sha256)).

``cpu``: agent CPU seconds (user+sys, psutil) per verified GiB for a plain upload to one agent
and for each agent of the relay chain (the middle ones receive from a peer, forward and verify),
against the CPU seconds of sha256 over the same file in 1 MiB chunks in this process
(``time.process_time`` around the updates): efficiency = sha256 CPU / agent CPU (target >= 0.75).
Also against a floor measured the same way: sha256 + write+fsync + recv (+ send for a forwarder).
Shares the loopback agents; its arm is interleaved with the loopback ones.

Usage: python bench/relay.py [--parts shaped,loopback,cpu] [--runs 3] [--rate 400mbit]
       [--rank 4096] [--replicas 8] [--mib 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from _limits import make_adapters, make_file, manifest_for, med, write_fsync_rate
from lorafleet.agent.config import AgentSettings
from lorafleet.agent.spec import AgentSpec
from lorafleet.bundle import AdapterBundle
from lorafleet.clients.agent import AsyncAgentClient
from lorafleet.launch import Launcher, Server
from lorafleet.protocol.agent import (
    ForwardPlan,
    ForwardTarget,
    RelayAccept,
    UploadSession,
    credential_digest,
)
from lorafleet.protocol.manifest import FileEntry
from lorafleet.protocol.relay import RelayRates, plan_fanout, relay_time
from lorafleet.testing import netbed

MiB = 1 << 20
GiB = 1 << 30
CHUNK = 4 * MiB
TRANSFERS = ("tree", "chain", "star")
"""tree: the relay with the planned fan-out (``protocol/relay.py``, told the bed's link rate);
chain: the relay with fan-out 1; star: ``remote_upload`` (one copy from the trainer to each)."""

# The Publisher process in the trainer's namespace: one Publisher per fleet size; one JSON
# request per line on stdin (adapter, n, transfer, name), one "RESULT <json>" line per answer.
TRAINER = r"""
import dataclasses, json, os, sys
from lorafleet.protocol.relay import RelayRates
from lorafleet.publisher import Publisher

cfg = json.loads(sys.stdin.readline())
link = cfg.pop("_link")
token = os.environ["RELAY_BENCH_TOKEN"]
rates = RelayRates(link_Bps=link)
pubs = {}
for n, (urls, router) in cfg.items():
    pubs[n, "tree"] = Publisher(urls, router, token=token, relay_rates=rates)
    pubs[n, "chain"] = pubs[n, "star"] = Publisher(urls, router, token=token, relay_fanout=1)
print("READY", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    transfer = "remote_upload" if req["kind"] == "star" else "relay"
    try:
        res = pubs[req["n"], req["kind"]].publish(req["adapter"], name=req["name"],
                                                  transfer=transfer)
        out = {"ok": True, **dataclasses.asdict(res)}
    except Exception as exc:
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print("RESULT " + json.dumps(out, default=str), flush=True)
for pub in set(pubs.values()):
    pub.close()
"""


def loadavg() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


# -- A: the shaped bed ---------------------------------------------------------------------------


def raw_chain(bed: netbed.NetBed, hosts: list[netbed.Host], n: int) -> float:
    """Seconds to move ``n`` bytes trainer -> hosts[0] -> ... -> hosts[-1] over plain TCP, each
    hop forwarding what it reads as it reads it (connections made before the clock starts)."""
    listeners, outs = [], []
    for host in hosts:
        with bed.inside(host):
            listeners.append(socket.create_server((host.addr, 0)))
            outs.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    with bed.inside(bed.trainer):
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    outs = [client, *outs[:-1]]  # the sender into each hop: created in the sender's namespace
    conns = []
    try:
        for sender, host, lst in zip(outs, hosts, listeners, strict=True):
            sender.connect((host.addr, lst.getsockname()[1]))
            conns.append(lst.accept()[0])
        received = 0
        done = threading.Event()

        def hop(i: int) -> None:
            nonlocal received
            buf = bytearray(MiB)
            view = memoryview(buf)
            nxt = outs[i + 1] if i + 1 < len(hosts) else None
            while k := conns[i].recv_into(buf):
                if nxt is None:
                    received += k
                else:
                    nxt.sendall(view[:k])
            if nxt is None:
                done.set()
            else:
                nxt.shutdown(socket.SHUT_WR)

        for i in range(len(hosts)):
            threading.Thread(target=hop, args=(i,), daemon=True).start()
        data = bytes(n)
        t = time.perf_counter()
        client.sendall(data)
        client.shutdown(socket.SHUT_WR)
        if not done.wait(120):
            raise RuntimeError("the raw chain never delivered its last byte")
        elapsed = time.perf_counter() - t
        if received != n:
            raise RuntimeError(f"the raw chain delivered {received} of {n} bytes")
        return elapsed
    finally:
        for s in (*conns, *outs, *listeners):
            s.close()


def cpu_s(procs: list[psutil.Process]) -> float:
    """User+system CPU seconds of these processes (threads included, children not)."""
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


class Trainer:
    """The Publisher process in the trainer's namespace."""

    def __init__(self, bed: netbed.NetBed, cfg: dict, token: str, log: Path) -> None:
        self.log = log
        self._err = open(log, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [*bed.exec_prefix(bed.trainer), sys.executable, "-c", TRAINER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            env={**os.environ, "RELAY_BENCH_TOKEN": token},
        )
        self._send(cfg)
        self._read("READY")

    def _send(self, obj: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def _read(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        while line := self.proc.stdout.readline():
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise RuntimeError(f"the trainer process ended: {self.log.read_text()[-3000:]}")

    def publish(self, **req: Any) -> dict:
        self._send(req)
        out = json.loads(self._read("RESULT "))
        if not out["ok"]:
            raise RuntimeError(f"publication {req} failed: {out['error']}")
        return out

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


def rate_Bps(rate: str) -> float:
    """A tc rate (``400mbit``, ``1gbit``) in bytes per second (tc's mbit is 10**6 bits)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, bits in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * bits / 8
    raise ValueError(f"unknown rate {rate!r}")


def part_shaped(args: argparse.Namespace, work: Path) -> None:
    sizes = tuple(n for n in (1, 2, 4, 8, 16) if n <= args.replicas)
    print(
        f"\n== shaped bed: {args.replicas} replicas, {args.rate}, all-linear LoRA r={args.rank} =="
    )
    if (why := netbed.netns_available()) is not None:
        print(f"skipped: {why}")
        return
    from lorafleet.tinymodel import ensure_tiny_model

    model = ensure_tiny_model()
    t = time.perf_counter()
    adapters = make_adapters(
        model, work / "adapters", len(sizes) * (1 + len(TRANSFERS) * args.runs), args.rank
    )
    size = AdapterBundle.from_dir(adapters[0], name="x").total_size
    print(
        f"{len(adapters)} adapters of {size / MiB:.2f} MiB made in {time.perf_counter() - t:.1f} s"
    )
    link = rate_Bps(args.rate)
    token = secrets.token_urlsafe(16)
    rows: dict[tuple[int, str], list[dict]] = defaultdict(list)
    raw1: list[float] = []
    chain: list[float] = []
    with (
        netbed.NetBed(args.replicas, rate=args.rate) as bed,
        Launcher(work / "logs-shaped") as launcher,
    ):
        t = time.perf_counter()
        replicas = netbed.start_replicas(
            bed,
            launcher,
            model,
            work / "data",
            token=token,
            engine_kwargs={"max_lora_rank": args.rank},
            settings=AgentSettings(max_lora_rank=args.rank),
            extra=tuple(args.agent_arg),
        )
        routers = {n: netbed.start_router(bed, launcher, replicas[:n], token=token) for n in sizes}
        print(f"{bed}: engines, agents and routers up in {time.perf_counter() - t:.1f} s")
        cfg: dict[str, Any] = {
            str(n): [[r.url for r in replicas[:n]], routers[n].url] for n in sizes
        }
        cfg["_link"] = link
        trainer = Trainer(bed, cfg, token, work / "trainer.log")
        procs = {
            "agents": [psutil.Process(r.agent.pid) for r in replicas],
            "engines": [psutil.Process(r.engine.pid) for r in replicas],
            "publisher": [psutil.Process(trainer.proc.pid)],  # ip netns exec execs python
        }
        try:
            it = iter(adapters)
            for n in sizes:  # warm-up: the first publication of a name retires nothing
                trainer.publish(adapter=str(next(it)), n=str(n), kind="chain", name=f"p{n}")
            for run in range(args.runs):
                raw1.append(raw_chain(bed, bed.replicas[:1], size))
                chain.append(raw_chain(bed, bed.replicas[: sizes[-1]], size))
                print(
                    f"run {run + 1} (load {loadavg()}): raw TCP trainer->r1 {raw1[-1]:.3f} s, "
                    f"raw chain trainer->r1..r{sizes[-1]} {chain[-1]:.3f} s",
                    flush=True,
                )
                order = TRANSFERS if run % 2 == 0 else TRANSFERS[::-1]
                for n in sizes:
                    for kind in order:
                        before = bed.tx_bytes(bed.trainer)
                        cpu0 = {k: cpu_s(v) for k, v in procs.items()}
                        res = trainer.publish(
                            adapter=str(next(it)), n=str(n), kind=kind, name=f"p{n}"
                        )
                        cpu = {k: cpu_s(v) - cpu0[k] for k, v in procs.items()}
                        egress = bed.tx_bytes(bed.trainer) - before
                        reps = res["replicas"].values()
                        row = {
                            "duration": res["duration_s"],
                            "upload": max(r["upload_s"] for r in reps),
                            "commit": max(r["verify_s"] for r in reps),
                            "load": max(r["load_s"] for r in reps),
                            "probe": max(r["probe_s"] for r in reps),
                            "cutover": res["cutover_s"],
                            "bytes_sent": res["bytes_sent"],
                            "egress": egress,
                            "relayed": sum(r["bytes_relayed"] for r in reps),
                            **{f"cpu_{k}": v for k, v in cpu.items()},
                        }
                        rows[n, kind].append(row)
                        print(
                            f"  N={n} {kind:5s}: {row['duration']:.3f} s (upload "
                            f"{row['upload']:.3f}, load {row['load']:.3f}), bytes_sent "
                            f"{row['bytes_sent'] / size:.2f}x, egress {egress / size:.3f}x, "
                            f"relayed {row['relayed'] / size:.2f}x; CPU s agents "
                            f"{cpu['agents']:.2f} engines {cpu['engines']:.2f}",
                            flush=True,
                        )
        finally:
            trainer.close()

    sr = med(raw1)
    top = sizes[-1]
    print(
        f"\nmedians over {args.runs} runs; adapter S = {size / MiB:.2f} MiB; load {loadavg()}\n"
        f"bed limit: raw TCP trainer->r1 S/R = {sr:.3f} s ({size * 8 / sr / 1e6:.0f} Mbit/s); "
        f"raw chain trainer->r1..r{top} {med(chain):.3f} s "
        f"(per raw hop {(med(chain) - sr) / max(top - 1, 1) * 1e3:.1f} ms)"
    )
    m: dict[tuple[int, str], dict[str, float]] = {
        k: {f: med([r[f] for r in v]) for f in v[0]} for k, v in rows.items()
    }
    # With one agent every arm is the same direct upload: pooled, t(1) has three times the runs.
    ones = [r for k in TRANSFERS for r in rows[1, k]]
    t1 = med([r["duration"] for r in ones])
    rates = RelayRates(link_Bps=link)
    print(f"t(N)/t(1) against the pooled N=1 median ({t1:.3f} s); tree fan-out as planned")
    print("| N | arm | fan-out | duration_s | upload_s | t(N)/t(1) | bytes_sent / S | egress / S |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in TRANSFERS:
        for n in sizes:
            x = m[n, kind]
            f = {"tree": plan_fanout(n, size, rates), "chain": 1, "star": n}[kind]
            print(
                f"| {n} | {kind} | {f} | {x['duration']:.3f} | {x['upload']:.3f} | "
                f"{x['duration'] / t1:.2f} | {x['bytes_sent'] / size:.2f} | "
                f"{x['egress'] / size:.3f} |"
            )
    print("\nbreakdown (medians, s; the slowest replica's; CPU s of the bed's processes)")
    print(
        "| N | arm | upload | commit | load | probe | cutover | CPU agents | CPU engines | busy |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kind in TRANSFERS:
        for n in sizes:
            x = m[n, kind]
            busy = (x["cpu_agents"] + x["cpu_engines"] + x["cpu_publisher"]) / (
                x["duration"] * (os.cpu_count() or 1)
            )
            print(
                f"| {n} | {kind} | "
                + " | ".join(
                    f"{x[k]:.3f}" for k in ("upload", "commit", "load", "probe", "cutover")
                )
                + f" | {x['cpu_agents']:.2f} | {x['cpu_engines']:.2f} | {busy:.0%} |"
            )
    h = (m[top, "chain"]["upload"] - m[1, "chain"]["upload"]) / max(top - 1, 1)
    print(
        f"\nper-hop time from the chain's uploads: h = (upload(N={top}) - upload(1)) / {top - 1} "
        f"= {h * 1e3:.1f} ms (raw TCP hop {(med(chain) - sr) / max(top - 1, 1) * 1e3:.1f} ms)"
    )
    fixed = t1 - sr
    for n_model in (16, 64, 256, 4096):
        model_rates = RelayRates(link_Bps=link, hop_s=h, fixed_s=fixed)
        f = plan_fanout(n_model, size, model_rates)
        print(
            f"model ({args.rate} links, h above): N={n_model}: planned fan-out {f}, "
            f"t = {relay_time(n_model, size, f, model_rates):.2f} s; chain "
            f"{relay_time(n_model, size, 1, model_rates):.2f} s"
        )


# -- B and C: loopback ---------------------------------------------------------------------------


def sha256_cpu(path: Path) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of sha256 over ``path`` in 1 MiB chunks, this process: only the
    ``update`` calls are timed, not the reads."""
    h = hashlib.sha256()
    buf = bytearray(MiB)
    cpu = wall = 0.0
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            view = memoryview(buf)[:k]
            c, w = time.process_time(), time.perf_counter()
            h.update(view)
            cpu += time.process_time() - c
            wall += time.perf_counter() - w
    return cpu, wall


def store_cpu(path: Path, scratch: Path) -> float:
    """CPU seconds of writing ``path``'s bytes to a new file on the agents' disk in 1 MiB chunks
    and fsyncing it once (the copy into the page cache, and the writeback work that fsync does
    in the caller; only the ``write`` and ``fsync`` calls are timed)."""
    buf = bytearray(MiB)
    cpu = 0.0
    out = scratch / "store-limit"
    with open(path, "rb", buffering=0) as f, open(out, "wb", buffering=0) as dst:
        while k := f.readinto(buf):
            view = memoryview(buf)[:k]
            c = time.process_time()
            dst.write(view)
            cpu += time.process_time() - c
        c = time.process_time()
        os.fsync(dst.fileno())
        cpu += time.process_time() - c
    out.unlink()
    return cpu


def socket_cpu(path: Path) -> tuple[float, float]:
    """(recv, send) CPU seconds of moving ``path``'s bytes over loopback TCP between two threads
    in 1 MiB chunks (``time.thread_time`` around ``recv_into`` and ``sendall`` only)."""
    send_cpu = 0.0
    with socket.create_server(("127.0.0.1", 0)) as lst:

        def send() -> None:
            nonlocal send_cpu
            buf = bytearray(MiB)
            with socket.create_connection(lst.getsockname()) as c, open(path, "rb") as f:
                while k := f.readinto(buf):
                    t = time.thread_time()
                    c.sendall(memoryview(buf)[:k])
                    send_cpu += time.thread_time() - t

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        conn, _ = lst.accept()
        buf = bytearray(MiB)
        with conn:
            t = time.thread_time()
            while conn.recv_into(buf):
                pass
            recv = time.thread_time() - t
        sender.join()
    return recv, send_cpu


class Agent:
    def __init__(self, server: Server[AgentSpec]) -> None:
        self.server = server
        self.url = server.url
        self.token = str(server.spec.token)
        self.ps = psutil.Process(server.pid)

    def cpu(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system


def start_agents(launcher: Launcher, root: Path, n: int, extra: Sequence[str] = ()) -> list[Agent]:
    """Agents with no engine behind them: uploads do not need one (they report not ready)."""
    servers = [
        launcher.spawn(
            AgentSpec(
                engine="vllm",
                engine_url="http://127.0.0.1:9",
                data_dir=root / f"agent{i}",
                token=secrets.token_urlsafe(16),
                extra=("--log-level", "warning", *extra),
                ready_status=503,
                name=f"agent{i}",
            )
        )
        for i in range(n)
    ]
    for s in servers:
        launcher.wait_ready(s)
    return [Agent(s) for s in servers]


async def transfer_arm(
    arm: str, agents: list[Agent], src: Path, entry: FileEntry, version: int
) -> dict[str, Any]:
    """One timed transfer (sessions opened before, discarded after): seconds, each agent's CPU
    seconds and this process's CPU seconds during it."""
    manifest = manifest_for(entry, "relaybench", version)
    used = agents[:1] if arm == "plain" else agents
    clients = [AsyncAgentClient(a.url, a.token, timeout=600) for a in used]
    sessions: list[UploadSession] = []
    try:
        accept = None
        cred = secrets.token_urlsafe(32)
        if arm == "relay":
            accept = RelayAccept(credential_sha256=credential_digest(cred), stall_s=30)
        sessions = await asyncio.gather(*(c.open_upload(manifest, relay=accept) for c in clients))
        for s in sessions:
            assert entry.path in s.missing, s
        if arm == "relay":
            for i in range(len(used) - 1):
                target = ForwardTarget(
                    url=used[i + 1].url,
                    upload_id=sessions[i + 1].upload_id,
                    answer_timeout_s=600,
                )
                plan = ForwardPlan(credential=cred, stall_s=30, files={entry.path: [target]})
                await clients[i].set_forward(sessions[i].upload_id, plan)
        senders = clients[:1] if arm == "relay" else clients
        cpu0 = [a.cpu() for a in used]
        own0 = time.process_time()
        t = time.perf_counter()
        progs = await asyncio.gather(
            *(
                c.upload_file(s.upload_id, entry, src, chunk_size=CHUNK)
                for c, s in zip(senders, sessions, strict=False)
            )
        )
        dt = time.perf_counter() - t
        own = time.process_time() - own0
        cpu = [a.cpu() - c0 for a, c0 in zip(used, cpu0, strict=True)]
        assert all(p.complete for p in progs), progs
        if arm == "relay":
            hops = progs[0].relayed
            assert len(hops) == len(used) - 1 and all(h.ok for h in hops), hops
        return {"s": dt, "cpu": cpu, "sender_cpu": own}
    finally:
        await asyncio.gather(
            *(c.discard(s.upload_id) for c, s in zip(clients, sessions, strict=False)),
            return_exceptions=True,
        )
        for c in clients:
            await c.aclose()


def part_loopback(args: argparse.Namespace, work: Path, parts: set[str]) -> None:
    size = args.mib * MiB
    print(f"\n== loopback: 4 engine-less agents, {args.mib} MiB random file ==")
    arms = (["star", "relay"] if "loopback" in parts else ["relay"]) + (
        ["plain"] if "cpu" in parts else []
    )
    src = work / "source.bin"
    entry = make_file(src, args.mib)
    cores = os.cpu_count() or 1
    res: dict[str, list[dict]] = defaultdict(list)
    sha_cpu: list[float] = []
    floor_cpu: list[tuple[float, float, float]] = []
    sha_rate: list[float] = []
    wr_rate: list[float] = []
    version = 0
    with Launcher(work / "logs-loopback") as launcher:
        agents = start_agents(launcher, work, 4, args.agent_arg)
        for run in range(args.runs):
            cpu, wall = sha256_cpu(src)
            sha_cpu.append(cpu)
            if "cpu" in parts:
                floor_cpu.append((store_cpu(src, work), *socket_cpu(src)))
            sha_rate.append(size / wall)
            wr_rate.append(write_fsync_rate(work, min(size, 256 * MiB)))
            print(
                f"run {run + 1} (load {loadavg()}): sha256 {sha_rate[-1] / MiB:.0f} MiB/s "
                f"({cpu:.3f} CPU s), write+fsync {wr_rate[-1] / MiB:.0f} MiB/s",
                flush=True,
            )
            k = run % len(arms)
            for arm in arms[k:] + arms[:k]:
                version += 1
                out = asyncio.run(transfer_arm(arm, agents, src, entry, version))
                res[arm].append(out)
                print(
                    f"  {arm:5s}: {out['s']:.3f} s ({size / out['s'] / GiB:.2f} GiB/s per copy); "
                    f"agent CPU s {', '.join(f'{c:.2f}' for c in out['cpu'])}; "
                    f"sender CPU s {out['sender_cpu']:.2f}",
                    flush=True,
                )
    gib = size / GiB
    print(f"\nmedians over {args.runs} runs; load {loadavg()}")
    sha, wr = med(sha_rate), med(wr_rate)
    floor = max(4 * size / wr, 4 * size / (cores * sha))
    print(
        f"machine: sha256 {sha / MiB:.0f} MiB/s, write+fsync {wr / MiB:.0f} MiB/s, {cores} cores; "
        f"floor for 4 verified copies max(4S/W, 4S/(cores*sha256)) = {floor:.3f} s"
    )
    if "loopback" in parts:
        print("| arm | seconds | GiB/s per copy | copies GiB/s | x floor | sender CPU s |")
        print("|---|---|---|---|---|---|")
        for arm in ("star", "relay"):
            s = med([r["s"] for r in res[arm]])
            print(
                f"| {arm} | {s:.3f} | {gib / s:.2f} | {4 * gib / s:.2f} | {s / floor:.2f} | "
                f"{med([r['sender_cpu'] for r in res[arm]]):.2f} |"
            )
        ratio = med([r["s"] for r in res["relay"]]) / med([r["s"] for r in res["star"]])
        per_run = [r["s"] / st["s"] for r, st in zip(res["relay"], res["star"], strict=True)]
        print(
            f"relay/star time = {ratio:.2f} (per run {', '.join(f'{x:.2f}' for x in per_run)}): "
            f"relay is {'not slower' if ratio <= 1 else 'SLOWER'} than star on loopback"
        )
        for arm in ("star", "relay"):
            cpus = [med([r["cpu"][i] for r in res[arm]]) for i in range(4)]
            print(
                f"{arm} agent CPU s per agent (0..3): {', '.join(f'{c:.2f}' for c in cpus)}; "
                f"all agents + sender {sum(cpus) + med([r['sender_cpu'] for r in res[arm]]):.2f}"
            )
    if "cpu" in parts:
        sc = med(sha_cpu) / gib
        plain = med([r["cpu"][0] for r in res["plain"]]) / gib
        middle = med([c for r in res["relay"] for c in r["cpu"][1:3]]) / gib
        root = med([r["cpu"][0] for r in res["relay"]]) / gib
        tail = med([r["cpu"][3] for r in res["relay"]]) / gib
        plain_s = med([r["s"] for r in res["plain"]])
        wc, rc, snd = (med([f[i] for f in floor_cpu]) / gib for i in range(3))
        fl = sc + wc + rc
        print(
            "\nagent CPU per verified GiB (user+sys) against sha256 of the same bytes, and against "
            "the floor of a receiver that stores what it verifies, each part measured in this "
            "process: sha256 + write+fsync (copy into the page cache, writeback started by fsync) "
            "+ recv (copy out of the socket), + send (copy into a socket) for one that forwards:"
        )
        print(
            f"sha256 {sc:.3f} + write+fsync {wc:.3f} + recv {rc:.3f} = receiver floor {fl:.3f}; "
            f"+ send {snd:.3f} = forwarder floor {fl + snd:.3f} CPU s / GiB "
            f"(sha256 alone is {sc / fl:.2f} of the receiver floor)"
        )
        print(
            "| agent | CPU s / GiB | efficiency sha256 / agent (target >= 0.75) | "
            "its floor / agent |"
        )
        print("|---|---|---|---|")
        print(f"| sha256 in this process | {sc:.3f} | 1.00 | |")
        for label, v, f in (
            (f"plain upload, one agent ({gib / plain_s:.2f} GiB/s)", plain, fl),
            ("relay middle (agents 1, 2: receive + forward)", middle, fl + snd),
            ("relay root (agent 0: receive from sender + forward)", root, fl + snd),
            ("relay tail (agent 3: receive only)", tail, fl),
        ):
            print(f"| {label} | {v:.3f} | {sc / v:.2f} | {f / v:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="shaped,loopback,cpu")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rate", default="400mbit", help="shaped: each host's egress (tc rate)")
    ap.add_argument("--rank", type=int, default=4096, help="shaped: LoRA rank (4096 = 64 MiB)")
    ap.add_argument("--replicas", type=int, default=8, help="shaped: replica hosts (N up to it)")
    ap.add_argument("--mib", type=int, default=1024, help="loopback/cpu: file size in MiB")
    ap.add_argument(
        "--agent-arg",
        action="append",
        default=[],
        help="an extra argument for every agent, e.g. --agent-arg=--direct-io-min-bytes=0",
    )
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if unknown := parts - {"shaped", "loopback", "cpu"}:
        ap.error(f"unknown parts: {', '.join(sorted(unknown))}")
    print(f"{os.cpu_count()} cores, load average {loadavg()} at start")
    with tempfile.TemporaryDirectory(
        prefix="lorafleet-bench-relay-", dir=os.environ.get("BENCH_DIR")
    ) as td:
        work = Path(td)
        if "shaped" in parts:
            part_shaped(args, work)
        if parts & {"loopback", "cpu"}:
            shutil.rmtree(work / "adapters", ignore_errors=True)  # free the disk first
            part_loopback(args, work, parts)


if __name__ == "__main__":
    main()
