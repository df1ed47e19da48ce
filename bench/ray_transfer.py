"""On Ray: the object-store transfer against the HTTP relay and the star, beside this machine's
own limits measured in the same run.

A local Ray cluster (``lorafleet.testing.raycluster``: ``--nodes`` nodes, all this machine on
127.0.0.1, 2 CPUs each) with a fleet from ``lorafleet.ray.deploy`` (``--replicas`` reference
engines with an agent beside each, spread across the nodes, and a router). The adapter is a real
PEFT adapter on the tiny model, all-linear LoRA at rank ``--rank`` (4096 * r fp32 parameters:
r=4096 is 64 MiB), with new bytes for every publication (agents deduplicate by content). This
process is the trainer (a Ray driver on the head node). Each run publishes once with each
transfer, in a rotated order: ``remote_upload`` (the star: one HTTP copy per agent),
``relay`` (one HTTP copy, agents forward it) and ``object_store`` (one ``ray.put``, each agent's
actor pulls it on its node and uploads it to its agent over loopback).

Recorded per publication: ``duration_s``, the slowest replica's transfer (``upload_s``) and
``bytes_sent`` (HTTP bytes that left the trainer). Limits, each run: sha256 and write+fsync
throughput, the floor for N verified copies on this machine (max(N S / write+fsync,
N S / (cores * sha256)): every copy is hashed and written once, on one box), and Ray's own
broadcast: ``ray.put`` of S bytes plus one task per replica node that ``ray.get``s it (no
verification, no disk). Ratios, from the medians: each transfer's ``upload_s`` over the floor,
the object store's ``upload_s`` over Ray's raw broadcast, and each transfer's ``duration_s``
over the star's.

On one machine every "node" shares the same cores, disk and loopback, so this measures the
software path's cost, not the network's; trainer egress on a real network is the ``bytes_sent``
column (the object store's equivalent is one ``ray.put``: Ray's object manager lets a node pull
from any node that already holds a copy).

Usage: python bench/ray_transfer.py [--runs 3] [--replicas 3] [--nodes 3] [--rank 4096]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from _limits import make_adapters, med, sha256_rate, write_fsync_rate
from lorafleet.agent.config import AgentSettings
from lorafleet.testing.raycluster import local_cluster
from lorafleet.tinymodel import ensure_tiny_model

MiB = 1 << 20
TRANSFERS = ("remote_upload", "relay", "object_store")
LABEL = {"remote_upload": "star", "relay": "relay", "object_store": "object store"}


def ray_broadcast(node_ids: list[str], size: int) -> float:
    """Seconds for ``ray.put`` of ``size`` bytes and one task per node that fetches it."""
    import numpy as np
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def fetch(arr: np.ndarray) -> int:
        return int(arr.nbytes)

    data = np.frombuffer(os.urandom(size), dtype=np.uint8)
    t = time.perf_counter()
    ref = ray.put(data)
    got = ray.get(
        [
            fetch.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(
                ref
            )
            for n in node_ids
        ]
    )
    elapsed = time.perf_counter() - t
    assert got == [size] * len(node_ids), got
    del ref
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rank", type=int, default=4096)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lf-bench-ray-"))
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> None:
    model = ensure_tiny_model()
    t = time.perf_counter()
    adapters = make_adapters(model, work / "adapters", 1 + len(TRANSFERS) * args.runs, args.rank)
    weights = adapters[0] / "adapter_model.safetensors"
    size = weights.stat().st_size
    print(f"{len(adapters)} adapters of {size / MiB:.1f} MiB in {time.perf_counter() - t:.1f} s")
    cores = os.cpu_count() or 1
    n = args.replicas
    object_store = max(512, 4 * size // MiB)
    with local_cluster(args.nodes, num_cpus=2, object_store_mib=object_store):
        from lorafleet.ray import deploy

        t = time.perf_counter()
        fleet = deploy(
            n,
            workdir=str(work / "ray"),
            engine_args={"max_lora_rank": args.rank},
            agent_args={"settings": AgentSettings(max_lora_rank=args.rank)},
            engine_cpus=1.0,
            max_restarts=0,
        )
        try:
            nodes = sorted({r.node_id for r in fleet.replicas})
            print(
                f"fleet up in {time.perf_counter() - t:.1f} s: {n} replicas on {len(nodes)} of "
                f"{args.nodes} nodes, {cores} cores, object store {object_store} MiB per node",
                flush=True,
            )
            ray_broadcast(nodes, MiB)  # warm-up: the fetch task's workers start once
            rows: dict[str, list[dict]] = defaultdict(list)
            limits: dict[str, list[float]] = defaultdict(list)
            it = iter(adapters)
            with fleet.publisher() as pub:
                pub.publish(str(next(it)), name="policy")  # warm-up: retires nothing
                for i in range(args.runs):
                    sha = sha256_rate(weights)
                    wr = write_fsync_rate(work, size)
                    floor = max(n * size / wr, n * size / (cores * sha))
                    bcast = ray_broadcast(nodes, size)
                    limits["sha256"].append(sha)
                    limits["write"].append(wr)
                    limits["floor"].append(floor)
                    limits["broadcast"].append(bcast)
                    print(
                        f"run {i + 1} (load {'/'.join(f'{x:.1f}' for x in os.getloadavg())}): "
                        f"sha256 {sha / MiB:.0f} MiB/s, write+fsync {wr / MiB:.0f} MiB/s, floor "
                        f"for {n} verified copies {floor:.3f} s, Ray broadcast to {len(nodes)} "
                        f"nodes {bcast:.3f} s",
                        flush=True,
                    )
                    k = i % len(TRANSFERS)
                    for transfer in TRANSFERS[k:] + TRANSFERS[:k]:
                        res = pub.publish(str(next(it)), name="policy", transfer=transfer)
                        assert res.transfer == transfer
                        upload = max(r.upload_s for r in res.replicas.values())
                        rows[transfer].append(
                            {"duration": res.duration_s, "upload": upload, "sent": res.bytes_sent}
                        )
                        print(
                            f"  {LABEL[transfer]:>12}: duration {res.duration_s:.3f} s, transfer "
                            f"{upload:.3f} s, HTTP bytes from the trainer "
                            f"{res.bytes_sent / size:.2f} copies",
                            flush=True,
                        )
        finally:
            fleet.shutdown()
    report(rows, limits, size, n)


def report(rows: dict[str, list[dict]], limits: dict[str, list[float]], size: int, n: int) -> None:
    floor, bcast = med(limits["floor"]), med(limits["broadcast"])
    star = med([r["duration"] for r in rows["remote_upload"]])
    print(
        f"\nmedians over {len(limits['floor'])} runs, {size / MiB:.0f} MiB to {n} replicas: "
        f"sha256 {med(limits['sha256']) / MiB:.0f} MiB/s, write+fsync "
        f"{med(limits['write']) / MiB:.0f} MiB/s, floor {floor:.3f} s, Ray broadcast {bcast:.3f} s"
    )
    print(
        f"{'transfer':>12} | duration s | vs star | transfer s | vs floor | vs Ray bcast | "
        "HTTP copies from trainer"
    )
    for transfer in TRANSFERS:
        got = rows[transfer]
        d, u = med([r["duration"] for r in got]), med([r["upload"] for r in got])
        sent = med([r["sent"] / size for r in got])
        print(
            f"{LABEL[transfer]:>12} | {d:10.3f} | {d / star:7.2f} | {u:10.3f} | {u / floor:8.2f} "
            f"| {u / bcast:12.2f} | {sent:.2f}"
        )


if __name__ == "__main__":
    main()
