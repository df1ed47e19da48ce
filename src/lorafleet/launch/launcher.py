"""``Launcher``: starts servers from specs, waits until they are ready, stops them all."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from lorafleet.launch import listen
from lorafleet.launch.process import ManagedProcess, ProcessExited
from lorafleet.launch.specs import PortServerSpec, ServerSpec, SocketServerSpec

__all__ = ["Launcher", "Server"]

S = TypeVar("S", bound=ServerSpec)

_ADDRESS_IN_USE = os.strerror(errno.EADDRINUSE).lower()  # "address already in use"


@dataclass(eq=False)
class Server(Generic[S]):
    """A server a ``Launcher`` started. ``proc`` changes when the launcher restarts it."""

    spec: S
    proc: ManagedProcess
    port: int
    log_path: Path
    _may_move: bool = field(default=False, repr=False)
    """A port-only server whose port the launcher chose, never ready yet: it may move."""

    @property
    def host(self) -> str:
        return self.spec.host

    @property
    def url(self) -> str:
        return f"http://{listen.url_host(self.spec.host)}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.alive()

    def stop(self) -> None:
        self.proc.stop()


class Launcher:
    """Starts servers and stops every one of them (newest first) at ``stop_all`` or exit.

    Each server logs to ``logdir/<spec.name>.log`` (``<name>-2.log``... when names repeat)::

        with Launcher(tmp / "logs") as launcher:
            engine = launcher.start(ReferenceEngineSpec(model=model))
            agent = launcher.start(AgentSpec(engine_url=engine.url, data_dir=tmp / "a"))
    """

    def __init__(self, logdir: str | os.PathLike) -> None:
        self.logdir = Path(logdir)
        self.servers: list[Server] = []
        self._log_names: set[str] = set()

    def spawn(self, spec: S) -> Server[S]:
        """Start ``spec``'s process without waiting for it.

        ``url`` is known at once for a socket server; a port-only one may still move to another
        port in ``wait_ready``.
        """
        log_path = self._log_path(spec.name)
        proc, port = self._launch(spec, spec.port, log_path)
        may_move = isinstance(spec, PortServerSpec) and spec.port == 0
        server = Server(spec, proc, port, log_path, _may_move=may_move)
        self.servers.append(server)
        return server

    def wait_ready(self, *servers: Server) -> None:
        """Wait for each server (they start in parallel); raise if one dies or times out.

        A port-only server that died because its reserved port was taken meanwhile is started
        again on a new port, up to ``spec.port_retries`` times.
        """
        for server in servers:
            retries = 0
            while True:
                try:
                    server.proc.wait_ready(server.spec.ready_timeout, server.spec.ready_status)
                    break
                except ProcessExited:
                    if not self._may_retry(server, retries):
                        raise
                    retries += 1
                    server.proc.stop()
                    server.proc, server.port = self._launch(server.spec, 0, server.log_path)
            server._may_move = False  # clients may know its URL from now on

    def start(self, spec: S) -> Server[S]:
        """``spawn`` then ``wait_ready``."""
        server = self.spawn(spec)
        self.wait_ready(server)
        return server

    def restart(self, server: Server[S], *, wait: bool = True) -> Server[S]:
        """Stop ``server`` (if it still runs) and start its spec again on the same port."""
        server.proc.stop()
        server._may_move = False
        server.proc, _ = self._launch(server.spec, server.port, server.log_path)
        if wait:
            self.wait_ready(server)
        return server

    def stop_all(self) -> None:
        """Stop every server, newest first (a router before its agents, agents before engines)."""
        for server in reversed(self.servers):
            server.stop()
        self.servers.clear()

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    # -- internals -----------------------------------------------------------------------------
    def _log_path(self, name: str) -> Path:
        stem, n = name, 1
        while stem in self._log_names:
            n += 1
            stem = f"{name}-{n}"
        self._log_names.add(stem)
        return self.logdir / f"{stem}.log"

    @staticmethod
    def _launch(spec: ServerSpec, port: int, log_path: Path) -> tuple[ManagedProcess, int]:
        if isinstance(spec, SocketServerSpec):
            sock = listen.bind_listener(spec.host, port)
            try:
                port = sock.getsockname()[1]
                argv = spec.argv(sock.fileno())
                pass_fds: tuple[int, ...] = (sock.fileno(),)
                proc = _process(spec, argv, port, log_path, pass_fds)
            finally:
                # The child has its own copy. Ours would keep accepting (and queueing)
                # connections after the child died, where clients must see a refusal.
                sock.close()
            return proc, port
        if isinstance(spec, PortServerSpec):
            port = port or listen.reserve_port(spec.host)
            return _process(spec, spec.argv(port), port, log_path, ()), port
        raise TypeError(f"{type(spec).__name__} is neither a socket nor a port server spec")

    @staticmethod
    def _may_retry(server: Server, retries: int) -> bool:
        spec = server.spec
        return (
            server._may_move
            and isinstance(spec, PortServerSpec)
            and retries < spec.port_retries
            and _ADDRESS_IN_USE in server.proc.log_text().lower()
        )


def _process(
    spec: ServerSpec, argv: list[str], port: int, log_path: Path, pass_fds: tuple[int, ...]
) -> ManagedProcess:
    ready_url = f"http://{listen.url_host(spec.host)}:{port}{spec.ready_path}"
    return ManagedProcess(
        argv,
        ready_url=ready_url,
        log_path=log_path,
        env=spec.environ(),
        name=spec.name,
        pass_fds=pass_fds,
        term_group=spec.term_group,
    )
