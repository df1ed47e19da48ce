"""The one actor lorafleet runs on Ray: a server (engine, agent or router) as a subprocess.

``ServerActor`` starts its server with ``lorafleet.launch`` (the same specs and launcher as
``lorafleet up``) on the node Ray placed it on, and keeps it as long as the actor lives. A watchdog
(``_reaper``) ends the server if the actor is killed.

A restarted actor on the same node takes the same port again, so the URLs the router and the
publisher hold stay valid and the agent finds its store and reconciles its engine. Ports, logs
and stores are kept per node (``workdir/node-<id>``): when a node dies, Ray re-places the
replica's placement group on another node, and there its agent actor asks its engine actor for
the engine's new URL, starts with an empty store, writes its new URL into the fleet's record and
tells the router (``PUT /v1/control/replicas/{id}``), which takes the replica off every version
until the next publication reaches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from lorafleet.engine.spec import ReferenceEngineSpec
from lorafleet.errors import InternalError, NotFound, TransportError, Unavailable
from lorafleet.launch import Launcher, Server, ServerSpec
from lorafleet.ray._record import find_record

__all__ = ["Seat", "ServerActor"]

log = logging.getLogger("lorafleet.ray")

_BIND_RETRY_S = 15.0
"""A restarted actor may find its port still held for a moment by the server of the actor it
replaces (until the watchdog has ended it)."""

_ENGINE_WAIT_S = 600.0
"""How long a re-placed agent waits for its engine actor's URL (a vLLM server takes minutes)."""

_TELL_ROUTER_S = 600.0
"""How long a re-placed agent keeps trying to tell the router its new URL (the router may be
restarting too; a restarted router reads the record anyway)."""


@dataclass(frozen=True)
class Seat:
    """A server's place in a fleet, so that its actor, restarted on another node, finds its
    engine again and tells the fleet where it listens now."""

    namespace: str
    role: str
    """agent or router (an engine's actor needs no seat: its agent finds it)."""
    replica: int | None = None
    """agent: its replica's index in the fleet's record."""
    engine_actor: str | None = None
    """agent: the engine actor to ask for the engine's URL (None: an attached engine's URL is
    fixed)."""


class ServerActor:
    """One lorafleet server on this actor's node. Created by ``lorafleet.ray``, not by hand.

    Args:
        spec: what to start. ``host=None`` (see ``bind``) is replaced by the node's address.
        workdir: on the node: logs and the port file (a restart reuses the port).
        bind: ``"node"``: listen on the node's Ray address (reachable from other nodes);
            anything else is taken as the host to bind.
        tiny_model: a reference engine whose model is the tiny model, generated on this node.
    """

    def __init__(
        self,
        spec: ServerSpec,
        workdir: str,
        bind: str = "node",
        tiny_model: bool = False,
        seat: Seat | None = None,
    ) -> None:
        self.node_id = ray.get_runtime_context().get_node_id()
        self.workdir = Path(workdir) / f"node-{self.node_id[:16]}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.seat = seat
        host = ray.util.get_node_ip_address() if bind == "node" else bind
        changes: dict[str, Any] = {"host": host}
        for f in ("data_dir", "state_dir"):  # relative: on this node, under its workdir
            v = getattr(spec, f, None)
            if isinstance(v, Path) and not v.is_absolute():
                changes[f] = self.workdir / v
        if tiny_model and isinstance(spec, ReferenceEngineSpec):
            from lorafleet.tinymodel import ensure_tiny_model

            changes["model"] = ensure_tiny_model()
        if seat is not None and seat.engine_actor is not None:
            changes["engine_url"] = _engine_url(seat)
        if seat is not None and seat.role == "router":
            record = find_record(seat.namespace)
            if record is not None:  # a restart: the agents may have moved since deployment
                got = ray.get(record.get.remote(), timeout=60)
                changes["agents"] = tuple(r["agent_url"] for r in got["replicas"])
        port_file = self.workdir / f"{spec.name}.port"
        if port_file.exists():  # a restart on this node: same address as before
            changes["port"] = int(port_file.read_text())
        self.spec = dataclasses.replace(spec, **changes)
        starts_file = self.workdir / f"{spec.name}.starts"
        self.starts = (int(starts_file.read_text()) if starts_file.exists() else 0) + 1
        starts_file.write_text(str(self.starts))
        self._launcher = Launcher(self.workdir / "logs")
        self.server: Server = self._start()
        port_file.write_text(str(self.server.port))
        _start_reaper(self.server.pid)
        self.told: str | None = None
        """What telling the fleet came to: None (not yet or nothing to tell), "moved",
        "in place", or an error."""
        if seat is not None and seat.role in ("agent", "router"):
            # Off the constructor: the actor answers while the router is being told.
            threading.Thread(target=self._tell_fleet, daemon=True).start()

    def _start(self) -> Server:
        deadline = time.monotonic() + _BIND_RETRY_S
        while True:
            try:
                return self._launcher.start(self.spec)
            except OSError:  # EADDRINUSE on the port file's port
                if self.spec.port == 0 or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def info(self) -> dict[str, Any]:
        """Where the server runs and whether it is alive."""
        return {
            "name": self.spec.name,
            "url": self.server.url,
            "pid": self.server.pid,
            "alive": self.server.alive(),
            "node_id": self.node_id,
            "actor_pid": os.getpid(),
            "log_path": str(self.server.log_path),
            "starts": self.starts,
            "told": self.told,
        }

    def url(self) -> str:
        return self.server.url

    def pull(
        self, refs: dict[str, ray.ObjectRef], upload_id: str, entries: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """An agent's actor: fetch each file from the object store (Ray brings it to this node)
        and upload it to this node's agent, which verifies it. Returns, per file, the agent's
        ``FileProgress`` (``complete``), or its refusal (``status``, ``code``, ``message``)."""
        import httpx

        from lorafleet._http import bearer, error_code, error_message
        from lorafleet.protocol.agent import (
            REPR_DIGEST_HEADER,
            UPLOAD_OFFSET_HEADER,
            file_url,
            repr_digest,
        )

        token = getattr(self.spec, "token", None)
        out: list[dict[str, Any]] = []
        with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
            for e in entries:
                data = ray.get(refs[e["path"]])
                resp = client.put(
                    self.server.url + file_url(upload_id, e["path"]),
                    content=data,
                    headers={
                        **bearer(token),
                        UPLOAD_OFFSET_HEADER: "0",
                        REPR_DIGEST_HEADER: repr_digest(e["sha256"]),
                        "Content-Type": "application/octet-stream",
                    },
                )
                if resp.status_code == 200:
                    out.append(resp.json())
                else:
                    out.append(
                        {
                            "complete": False,
                            "status": resp.status_code,
                            "code": error_code(resp),
                            "message": error_message(resp),
                        }
                    )
                    break
        return out

    def _tell_fleet(self) -> None:
        seat = self.seat
        assert seat is not None
        try:
            record = find_record(seat.namespace)
            if record is None:  # being deployed: the deployer writes the record
                return
            if seat.role == "router":
                ray.get(record.set_router_url.remote(self.server.url), timeout=60)
                self.told = "in place"
                return
            was = ray.get(
                record.place_replica.remote(
                    seat.replica,
                    agent_url=self.server.url,
                    engine_url=self.spec.engine_url,
                    node_id=self.node_id,
                ),
                timeout=60,
            )
            if was is None:
                self.told = "in place"
                return
            for attempt in Retrying(
                retry=retry_if_exception_type((TransportError, Unavailable, InternalError)),
                wait=wait_exponential(multiplier=0.5, max=10),
                stop=stop_after_delay(_TELL_ROUTER_S),
                reraise=True,
            ):
                with attempt:
                    router_url = ray.get(record.get.remote(), timeout=60)["router_url"]
                    asyncio.run(self._move(router_url, was))
            self.told = "moved"
            log.warning("replica %s moved: %s -> %s", seat.replica, was, self.server.url)
        except Exception as exc:  # reported by info(); the router still polls the record's URL
            self.told = f"{type(exc).__name__}: {exc}"
            log.exception("replica %s could not tell the fleet it moved", seat.replica)

    async def _move(self, router_url: str, was: str) -> None:
        from lorafleet.clients.router import AsyncRouterClient

        token = getattr(self.spec, "token", None)
        async with AsyncRouterClient(router_url, token) as router:
            # The router knows the replica by its agent URL, and by the id the agent reported.
            ids = [x for x in (was, getattr(self.spec, "replica_id", None)) if x]
            for replica_id in ids[:-1]:
                with contextlib.suppress(NotFound):
                    await router.move_replica(replica_id, self.server.url)
                    return
            await router.move_replica(ids[-1], self.server.url)

    def log_tail(self, n: int = 40) -> str:
        return self.server.proc.log_tail(n)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL); its watchdog leaves once the group is gone."""
        self._launcher.stop_all()


def _start_reaper(server_pid: int) -> None:
    """Start the watchdog that kills ``server_pid``'s process group once this actor dies."""
    # Run as a file, not a module: ``-m`` would import lorafleet.ray and with it Ray (seconds).
    script = Path(__file__).with_name("_reaper.py")
    subprocess.run(
        [sys.executable, str(script), str(os.getpid()), str(server_pid)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        check=True,
        timeout=60,
    )


def _engine_url(seat: Seat) -> str:
    """The engine actor's URL: it is placed with this actor and may still be starting."""
    deadline = time.monotonic() + _ENGINE_WAIT_S
    while True:
        try:
            engine = ray.get_actor(seat.engine_actor, namespace=seat.namespace)
            return ray.get(engine.url.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
