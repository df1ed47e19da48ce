"""The watchdog beside a server an actor launched: when the actor's worker dies the way a Ray
worker does (its direct children killed, then itself), the server's whole process group goes,
grandchildren included (vLLM's ``EngineCore``); after a clean stop the watchdog leaves by itself.

No Ray cluster: the worker is a plain process that starts its server and watchdog exactly as
``ServerActor`` does (``_start_reaper``), and the test kills it as Ray kills a worker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lorafleet.testing import wait_until
from tests.on_ray.procs import children, group_members, reapers

# The server leads its own session (as lorafleet.launch starts it) and has a child of its own.
_WORKER = """
import os, signal, subprocess, sys, time
from lorafleet.ray._actors import _start_reaper
server = subprocess.Popen(
    [sys.executable, "-c",
     "import subprocess, sys, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"],
    start_new_session=True,
)
_start_reaper(server.pid)
print(server.pid, flush=True)
sys.stdin.readline()  # "stop": what ManagedProcess.stop ends with
os.killpg(server.pid, signal.SIGKILL)
server.wait()
time.sleep(600)
"""


@pytest.fixture
def worker():
    root = Path(__file__).resolve().parents[2]
    env = dict(
        os.environ, PYTHONPATH=f"{root / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", _WORKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    server_pid = int(proc.stdout.readline())
    wait_until(
        lambda: len(group_members(server_pid)) == 2, timeout=10, message="the server's child"
    )
    try:
        yield proc, server_pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server_pid, signal.SIGKILL)
        for pid in reapers(server_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_a_worker_killed_as_ray_kills_it_takes_the_servers_whole_group(worker):
    proc, server_pid = worker
    assert reapers(server_pid), "the watchdog runs"
    # What Ray does when a worker exits: SIGKILL its direct children, then the worker.
    for child in children(proc.pid):
        os.kill(child, signal.SIGKILL)
    proc.kill()
    proc.wait()
    wait_until(lambda: not group_members(server_pid), timeout=10, message="the server's group gone")
    wait_until(lambda: not reapers(server_pid), timeout=5, message="the watchdog gone")


def test_the_watchdog_leaves_once_the_group_is_stopped(worker):
    proc, server_pid = worker
    proc.stdin.write("stop\n")
    proc.stdin.flush()
    wait_until(
        lambda: not reapers(server_pid), timeout=5, message="the watchdog left after a clean stop"
    )
    assert proc.poll() is None  # and it did not touch the worker
