"""lorafleet.testing.netbed: a shaped namespace testbed, a real fleet on it, a clean teardown.

Needs root and network namespaces; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from lorafleet.launch import Launcher
from lorafleet.testing import greedy_completion, make_peft_adapter, netbed

pytestmark = pytest.mark.skipif(
    netbed.netns_available() is not None, reason=str(netbed.netns_available())
)

RATE = "100mbit"

# Run in the trainer's namespace: publish a PEFT adapter directory, print the result as JSON.
PUBLISH = """
import dataclasses, json, os, sys
from lorafleet.publisher import Publisher

agents, router, adapter = json.loads(sys.argv[1])
with Publisher(agents, router, token=os.environ["NETBED_TOKEN"]) as pub:
    result = pub.publish(adapter, name="policy")
print(json.dumps(dataclasses.asdict(result)))
"""


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.startswith(prefix)]


def _timed_send(bed: netbed.NetBed, dst: netbed.Host, n: int) -> float:
    """Seconds to move ``n`` bytes trainer -> ``dst`` over a plain TCP connection."""
    with bed.inside(dst):
        listener = socket.create_server((dst.addr, 0))
    received = 0
    done = threading.Event()

    def receive() -> None:
        nonlocal received
        conn, _ = listener.accept()
        with conn:
            while chunk := conn.recv(1 << 20):
                received += len(chunk)
        done.set()

    with listener:
        threading.Thread(target=receive, daemon=True).start()
        with bed.inside(bed.trainer):
            client = socket.create_connection((dst.addr, listener.getsockname()[1]), timeout=30)
        with client:
            start = time.monotonic()
            client.sendall(b"\0" * n)
            client.shutdown(socket.SHUT_WR)
            assert done.wait(30), "the receiver never saw the end of the stream"
            elapsed = time.monotonic() - start
    assert received == n
    return elapsed


def test_the_bed_is_shaped_and_leaves_nothing_behind():
    with netbed.NetBed(2, rate=RATE) as bed:
        prefix = bed.prefix
        assert set(_namespaces(prefix)) == {bed.bridge_ns, *(h.ns for h in bed.hosts)}
        assert [h.addr.rsplit(".", 1)[1] for h in bed.hosts] == ["1", "11", "12"]
        # lo is up everywhere: a server on 127.0.0.1 in a replica is reachable there.
        for host in bed.hosts:
            assert "UP" in bed.run(host, ["ip", "-br", "link", "show", "lo"]).stdout
        before = bed.tx_bytes(bed.trainer)
        # 8 MiB at 100 Mbit/s is ~0.67 s (the 256 kb burst goes at once).
        elapsed = _timed_send(bed, bed.replicas[1], 8 << 20)
        assert elapsed >= 0.5, f"8 MiB took {elapsed:.3f}s: the link is not shaped to {RATE}"
        assert bed.tx_bytes(bed.trainer) - before >= 8 << 20
        assert bed.tx_bytes(bed.replicas[0]) < 1 << 20  # r1 took no part
    assert _namespaces(prefix) == []


def test_a_failed_setup_deletes_what_it_made(monkeypatch):
    real_ip = netbed._ip
    made = []

    def failing_ip(*args: str) -> str:
        if args[:2] == ("netns", "add"):
            made.append(args[2])
        if len(made) == 3 and "addr" in args:  # the bridge, the trainer, r1: r1's address
            raise RuntimeError("injected failure")
        return real_ip(*args)

    monkeypatch.setattr(netbed, "_ip", failing_ip)
    with pytest.raises(RuntimeError, match="injected failure"):
        netbed.NetBed(2)
    assert len(made) == 3 and made[0].endswith("br")
    assert _namespaces(made[0].removesuffix("br")) == []


def test_publish_from_the_trainer_to_replicas_across_the_bed(tiny_model, tmp_path):
    adapter = make_peft_adapter(tiny_model, tmp_path / "adapter", r=8, seed=7)
    token = "netbed-token"
    with (
        netbed.NetBed(2, rate=RATE) as bed,
        Launcher(tmp_path / "logs") as launcher,
    ):
        prefix = bed.prefix
        replicas = netbed.start_replicas(bed, launcher, tiny_model, tmp_path / "data", token=token)
        router = netbed.start_router(bed, launcher, replicas, token=token)
        # Every server is in its host, on its address on the bridge.
        for r in replicas:
            assert r.engine.url.startswith(f"http://{r.host.addr}:")
            assert r.agent.url.startswith(f"http://{r.host.addr}:")
            assert bed.host_of(r.engine) == bed.host_of(r.agent) == r.host
        assert router.url.startswith(f"http://{bed.trainer.addr}:")
        sent_before = bed.tx_bytes(bed.trainer)

        out = netbed.run_in_netns(
            bed.trainer,
            [
                sys.executable, "-c", PUBLISH,
                json.dumps([[r.url for r in replicas], router.url, str(adapter)]),
            ],
            env={**os.environ, "NETBED_TOKEN": token},
            check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert (result["version"], result["active_version"]) == (1, 1)
        assert result["engine_name"] == "policy@v1"
        assert set(result["replicas"]) == {r.url.removeprefix("http://") for r in replicas}
        # What the Publisher sent left through the trainer's shaped link.
        assert result["bytes_sent"] > 0
        assert bed.tx_bytes(bed.trainer) - sent_before >= result["bytes_sent"]

        # The trainer's namespace serves the new version through the router.
        with bed.inside(bed.trainer):
            status, ids, body = greedy_completion(router.url, "policy")
        assert status == 200 and ids, body
    assert _namespaces(prefix) == []
