"""A shaped network of Linux network namespaces, for tests and benchmarks (needs root).

``NetBed(n)`` builds, under a prefix of its own:
one bridge namespace and, on that bridge, one "trainer" host and ``n`` "replica" hosts, each in
its own namespace with an ``eth0`` whose egress is shaped by ``tc tbf`` (``rate RATE burst 256kb
latency 50ms``) and with ``lo`` up. Nothing is added to the caller's own namespace, and traffic
between the hosts never leaves theirs::

    from lorafleet.launch import Launcher
    from lorafleet.testing import netbed

    if (reason := netbed.netns_available()) is not None:
        raise SystemExit(reason)
    with netbed.NetBed(2, rate="100mbit") as bed, Launcher(logs) as launcher:
        replicas = netbed.start_replicas(bed, launcher, model, data_root, token=token)
        router = netbed.start_router(bed, launcher, [r.agent for r in replicas], token=token)
        out = netbed.run_in_netns(bed.trainer, PUBLISH_SCRIPT)  # a subprocess on the trainer
        print(bed.tx_bytes(bed.trainer))

Names and addresses. Every instance picks a fresh prefix, ``lf<4 hex>-``, and a fresh
``10.<100..250>.<0..255>.0/24``: namespaces ``<prefix>br`` (the bridge), ``<prefix>t`` (the
trainer, ``.1``) and ``<prefix>r1``... (the replicas, ``.11``, ``.12``...), so parallel or aborted
runs never collide. ``close()`` (or leaving the ``with`` block) kills what still runs in those
namespaces and deletes every one of them, also after a setup that failed half way.

How servers run inside a host. ``in_netns(host)`` moves the *calling thread* into the host's
namespace (``setns(2)``) and back. The launcher then works unchanged inside it: the listening
socket it binds is the host's, the child it forks starts in the host's namespace (a child takes
the namespace of the thread that forks it; no ``ip netns exec`` is needed), and its readiness probe
(``httpx.get``, a fresh connection per poll) reaches ``127.0.0.1`` or the host's address from
there. ``NetBed.spawn``/``wait_ready``/``start``/``restart`` do exactly this and remember each
server's host; ``start_replica(s)`` and ``start_router`` build the usual fleet with them. A
replica's engine and agent listen on the replica's address (the router sends inference straight
to the engine URL the agent reports, so engines must be reachable from the trainer), the router
on the trainer's: their URLs work from every host of the bed, not from the caller's namespace.

Client code on the trainer. ``run_in_netns(bed.trainer, code_or_argv)`` runs it as a subprocess
under ``ip netns exec``: every socket, thread and child of that process is in the trainer's
namespace, which is what a Publisher (an event loop in a thread of its own, connection pools,
worker threads) needs. ``in_netns`` also works for plain synchronous socket code, but a socket
belongs to the namespace its thread was in when the socket was *created*, and a thread started
inside the block stays in that namespace for good, so anything that connects later, lazily or
from another thread is only safe in a subprocess.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from lorafleet.agent.spec import AgentSpec
from lorafleet.engine.spec import ReferenceEngineSpec
from lorafleet.launch import Launcher, Server
from lorafleet.launch.specs import ServerSpec
from lorafleet.router.spec import RouterSpec

__all__ = [
    "Host",
    "NetBed",
    "NetReplica",
    "in_netns",
    "netns_available",
    "run_in_netns",
    "start_replica",
    "start_replicas",
    "start_router",
]

_S = TypeVar("_S", bound=ServerSpec)

_CLONE_NEWNET = 0x40000000
_NETNS_DIR = Path("/var/run/netns")
_IFNAMSIZ = 15  # the longest interface name Linux takes
_TBF = ("burst", "256kb", "latency", "50ms")  # as netbed.sh shapes each host


@dataclass(frozen=True)
class Host:
    """One host of a bed: its network namespace and its address on the bed's bridge."""

    name: str
    """``t`` for the trainer, ``r1``, ``r2``... for the replicas."""
    ns: str
    """The network namespace (``ip netns`` name)."""
    addr: str
    """Its IPv4 address on ``eth0``."""


@dataclass
class NetReplica:
    """A replica started on a bed: the engine and its agent, both on ``host.addr`` (reachable
    from every host of the bed)."""

    host: Host
    engine: Server[ReferenceEngineSpec]
    agent: Server[AgentSpec]

    @property
    def url(self) -> str:
        """The agent's URL."""
        return self.agent.url


# -- the calling thread's network namespace -----------------------------------------------------


def _ns_name(host: Host | str) -> str:
    return host.ns if isinstance(host, Host) else host


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)  # Python 3.11 has no os.setns


def _setns(fd: int) -> None:
    if _libc().setns(ctypes.c_int(fd), ctypes.c_int(_CLONE_NEWNET)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


@contextlib.contextmanager
def in_netns(host: Host | str) -> Iterator[None]:
    """Run the block with the calling thread in ``host``'s network namespace (a ``Host`` or an
    ``ip netns`` name), then move it back to the namespace it was in.

    Only this thread moves. Sockets created in the block belong to the namespace for their whole
    life; children forked in the block start in it; threads started in the block stay in it.
    """
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(_NETNS_DIR / _ns_name(host), os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


def run_in_netns(
    host: Host | str,
    command: Sequence[str] | str,
    *,
    check: bool = True,
    timeout: float | None = 120.0,
    **kwargs: Any,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` under ``ip netns exec`` in ``host``'s namespace; output captured as text.

    ``command`` is an argv, or a string of Python code run with this interpreter
    (``python -c CODE``). ``kwargs`` go to ``subprocess.run`` (``env``, ``cwd``, ``input``...);
    the environment is inherited. ``check``: raise ``CalledProcessError`` on a non-zero status.
    """
    argv = [sys.executable, "-c", command] if isinstance(command, str) else list(command)
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    return subprocess.run(
        ["ip", "netns", "exec", _ns_name(host), *argv], check=check, timeout=timeout, **kwargs
    )


# -- setup ---------------------------------------------------------------------------------------


def _ip(*args: str) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {(out.stderr or out.stdout).strip()}")
    return out.stdout


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def _fresh_prefix() -> str:
    existing = _netns_names()
    while True:
        prefix = f"lf{secrets.token_hex(2)}-"
        if not any(name.startswith(prefix) for name in existing):
            return prefix


@cache
def netns_available() -> str | None:
    """None if network namespaces, veth pairs, tbf and ``setns`` all work here; else why not.

    It really tries: it makes two throwaway namespaces joined by a veth pair, shapes one end,
    enters one from this thread and deletes both. Cached for the life of the process. Tests skip
    with the reason it returns.
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    made: list[str] = []
    try:
        prefix = _fresh_prefix()
        a, b = f"{prefix}ck1", f"{prefix}ck2"
        for ns in (a, b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("-n", a, "link", "add", f"v{b}", "type", "veth", "peer", "name", "eth0", "netns", b)
        tc = run_in_netns(
            b, ["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "1mbit", *_TBF],
            check=False, timeout=30,
        )  # fmt: skip
        if tc.returncode != 0:
            return f"tc tbf failed: {(tc.stderr or tc.stdout).strip()}"
        with in_netns(b):
            pass
        return None
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return f"network namespaces unavailable: {exc}"
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


class NetBed:
    """A trainer and ``n_replicas`` replicas, each in a namespace of its own on one bridge, every
    host's egress shaped to ``rate`` (a tc rate: ``400mbit``, ``1gbit``...). Built at once;
    ``close()`` or the end of a ``with`` block takes it down. Needs root (``netns_available``).

    ``prefix`` (``lf<4 hex>-`` by default) starts every namespace name; ``subnet`` is the first
    three octets of the /24 (default: random ``10.<100..250>.<0..255>``).
    """

    def __init__(
        self,
        n_replicas: int,
        rate: str = "400mbit",
        *,
        prefix: str | None = None,
        subnet: str | None = None,
    ) -> None:
        if not 1 <= n_replicas <= 240:
            raise ValueError(f"n_replicas must be in 1..240, not {n_replicas}")
        self.rate = rate
        self.prefix = prefix or _fresh_prefix()
        self.subnet = subnet or f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
        self.bridge_ns = f"{self.prefix}br"
        self.trainer = Host("t", f"{self.prefix}t", f"{self.subnet}.1")
        self.replicas = [
            Host(f"r{i}", f"{self.prefix}r{i}", f"{self.subnet}.{10 + i}")
            for i in range(1, n_replicas + 1)
        ]
        for host in self.hosts:
            if len(self._veth(host)) > _IFNAMSIZ:
                raise ValueError(f"prefix {self.prefix!r} too long for interface names")
        self.namespaces: list[str] = []
        """Every namespace made so far (what ``close`` deletes)."""
        self._server_hosts: dict[Server, Host] = {}
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    @property
    def hosts(self) -> list[Host]:
        """The trainer, then the replicas."""
        return [self.trainer, *self.replicas]

    def _veth(self, host: Host) -> str:
        return f"v{host.ns}"  # the bridge's end; the host's end is eth0

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _setup(self) -> None:
        br = self.bridge_ns
        self._add_ns(br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for host in self.hosts:
            self._add_ns(host.ns)
            veth = self._veth(host)
            _ip("-n", br, "link", "add", veth, "type", "veth", "peer", "name", "eth0",
                "netns", host.ns)  # fmt: skip
            _ip("-n", br, "link", "set", veth, "master", "br0")
            _ip("-n", br, "link", "set", veth, "up")
            _ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            _ip("-n", host.ns, "link", "set", "eth0", "up")
            self.run(host, ["tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                            "rate", self.rate, *_TBF])  # fmt: skip

    # -- commands and counters in a host -------------------------------------------------------
    def exec_prefix(self, host: Host) -> list[str]:
        """argv prefix that runs a command in ``host``: ``["ip", "netns", "exec", ns]``."""
        return ["ip", "netns", "exec", host.ns]

    def run(
        self, host: Host, argv: Sequence[str] | str, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """``run_in_netns(host, argv, **kwargs)``: argv (or Python code) in ``host``, captured,
        checked."""
        return run_in_netns(host, argv, **kwargs)

    def inside(self, host: Host) -> contextlib.AbstractContextManager[None]:
        """``in_netns(host)``: the calling thread in ``host``'s namespace for a block."""
        return in_netns(host)

    def _eth0_stats(self, host: Host) -> dict[str, Any]:
        link = json.loads(_ip("-n", host.ns, "-s", "-j", "link", "show", "eth0"))[0]
        return link.get("stats64") or link["stats"]

    def tx_bytes(self, host: Host) -> int:
        """Bytes ``host`` has sent on its ``eth0`` since the bed was built, as the kernel counts
        them (payload plus one set of headers per, possibly segmentation-offloaded, packet)."""
        return int(self._eth0_stats(host)["tx"]["bytes"])

    # -- servers in a host -----------------------------------------------------------------------
    def spawn(self, launcher: Launcher, host: Host, spec: _S) -> Server[_S]:
        """``launcher.spawn(spec)`` inside ``host``: the socket is bound there (``spec.host``
        must be ``127.0.0.1`` or ``host.addr``) and the process starts there."""
        with in_netns(host):
            server = launcher.spawn(spec)
        self._server_hosts[server] = host
        return server

    def wait_ready(self, launcher: Launcher, *servers: Server) -> None:
        """``launcher.wait_ready`` for servers spawned on this bed, each probed from its host
        (a port-only server that must move to a new port moves within its host)."""
        for server in servers:
            with in_netns(self.host_of(server)):
                launcher.wait_ready(server)

    def start(self, launcher: Launcher, host: Host, spec: _S) -> Server[_S]:
        """``spawn`` then ``wait_ready``."""
        server = self.spawn(launcher, host, spec)
        self.wait_ready(launcher, server)
        return server

    def restart(self, launcher: Launcher, server: Server[_S], *, wait: bool = True) -> Server[_S]:
        """``launcher.restart`` in the server's host (same port, same namespace)."""
        with in_netns(self.host_of(server)):
            return launcher.restart(server, wait=wait)

    def host_of(self, server: Server) -> Host:
        """The host a server was started in by this bed (``KeyError`` for any other)."""
        return self._server_hosts[server]

    # -- teardown --------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill whatever still runs in the bed's namespaces and delete all of them. Idempotent.

        Stop servers first (leave the ``Launcher`` before the bed) to stop them politely; the
        processes killed here can only be the bed's own, since its namespace names are unique.
        """
        for ns in reversed(self.namespaces):
            pids = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        errors = []
        for ns in reversed(self.namespaces):
            out = subprocess.run(
                ["ip", "netns", "del", ns], capture_output=True, text=True, timeout=30
            )
            if out.returncode != 0 and ns in _netns_names():
                errors.append(f"{ns}: {out.stderr.strip()}")
        self.namespaces.clear()
        self._server_hosts.clear()
        if errors:
            raise RuntimeError("could not delete namespaces: " + "; ".join(errors))

    def __enter__(self) -> NetBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"NetBed(prefix={self.prefix!r}, subnet={self.subnet}.0/24, rate={self.rate!r}, "
            f"replicas={len(self.replicas)})"
        )


# -- the usual fleet on a bed --------------------------------------------------------------------


def _engine_spec(host: Host, model: Path, kwargs: dict[str, Any] | None) -> ReferenceEngineSpec:
    # On the replica's address, not its loopback: the router sends inference straight to the
    # engine URL the agent reports (/v1/info), so the trainer's namespace must reach it.
    kwargs = {"host": host.addr, "name": f"{host.name}-engine", **(kwargs or {})}
    return ReferenceEngineSpec(model=Path(model), **kwargs)


def _agent_spec(
    host: Host, engine: Server, data_dir: Path, token: str, kwargs: dict[str, Any]
) -> AgentSpec:
    kwargs = {"name": f"{host.name}-agent", **kwargs}
    return AgentSpec(
        host=host.addr, engine_url=engine.url, data_dir=Path(data_dir), token=token, **kwargs
    )


def start_replicas(
    bed: NetBed,
    launcher: Launcher,
    model: Path,
    data_root: Path,
    *,
    token: str | None = None,
    engine_kwargs: dict[str, Any] | None = None,
    **agent_kwargs: Any,
) -> list[NetReplica]:
    """A reference engine and an agent in every replica host of ``bed``, the engines started in
    parallel, then the agents.

    Both listen on the replica's address (the router reaches engines directly, at the URL their
    agent reports). Agent ``i`` keeps its data in ``data_root/r<i>`` and takes ``token`` (default:
    one fresh random token, shared by all: ``replica.agent.spec.token``). ``engine_kwargs`` go to
    ``ReferenceEngineSpec``, ``agent_kwargs`` to ``AgentSpec`` (``replica_id``, ``extra``,
    ``ready_timeout``...). Logs: ``r<i>-engine.log`` and ``r<i>-agent.log`` in the launcher's
    log directory.
    """
    token = token or secrets.token_urlsafe(16)
    engines = [
        bed.spawn(launcher, host, _engine_spec(host, model, engine_kwargs)) for host in bed.replicas
    ]
    bed.wait_ready(launcher, *engines)
    agents = [
        bed.spawn(
            launcher,
            host,
            _agent_spec(host, engine, Path(data_root) / host.name, token, agent_kwargs),
        )
        for host, engine in zip(bed.replicas, engines, strict=True)
    ]
    bed.wait_ready(launcher, *agents)
    return [
        NetReplica(host, engine, agent)
        for host, engine, agent in zip(bed.replicas, engines, agents, strict=True)
    ]


def start_replica(
    bed: NetBed,
    launcher: Launcher,
    i: int,
    model: Path,
    data_dir: Path,
    *,
    token: str | None = None,
    engine_kwargs: dict[str, Any] | None = None,
    **agent_kwargs: Any,
) -> NetReplica:
    """A reference engine and its agent in replica ``i`` (0-based: ``bed.replicas[i]``), as
    ``start_replicas`` starts each; the agent keeps its data in ``data_dir``."""
    host = bed.replicas[i]
    engine = bed.start(launcher, host, _engine_spec(host, model, engine_kwargs))
    token = token or secrets.token_urlsafe(16)
    agent = bed.start(launcher, host, _agent_spec(host, engine, data_dir, token, agent_kwargs))
    return NetReplica(host, engine, agent)


def start_router(
    bed: NetBed,
    launcher: Launcher,
    agents: Sequence[NetReplica | Server | str],
    *,
    token: str | None,
    **router_kwargs: Any,
) -> Server[RouterSpec]:
    """``lorafleet router`` in the trainer's namespace on the trainer's address, over ``agents``
    (replicas, agent servers or URLs). ``router_kwargs`` go to ``RouterSpec`` (``api_key``,
    ``state_dir``, ``health_interval``...)."""
    urls = tuple(a if isinstance(a, str) else a.url for a in agents)
    spec = RouterSpec(host=bed.trainer.addr, agents=urls, token=token, **router_kwargs)
    return bed.start(launcher, bed.trainer, spec)
