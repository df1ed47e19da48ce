"""The one actor lorafleet runs on Ray: a server (engine, agent or router) as a subprocess.

``ServerActor`` starts its server with ``lorafleet.launch`` (the same specs and launcher as
``lorafleet up``) on the node Ray placed it on, and keeps it as long as the actor lives. A watchdog
(``_reaper``) ends the server if the actor is killed, and a restarted actor (``max_restarts``)
takes the same port again, so the agent URLs the router and the publisher hold stay valid and the
agent finds its store and reconciles its engine.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ray

from lorafleet.launch import Launcher, ReferenceEngineSpec, Server, ServerSpec

__all__ = ["ServerActor"]

_BIND_RETRY_S = 15.0
"""A restarted actor may find its port still held for a moment by the server of the actor it
replaces (until the watchdog has ended it)."""


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
        self, spec: ServerSpec, workdir: str, bind: str = "node", tiny_model: bool = False
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        host = ray.util.get_node_ip_address() if bind == "node" else bind
        changes: dict[str, Any] = {"host": host}
        if tiny_model and isinstance(spec, ReferenceEngineSpec):
            from lorafleet.tinymodel import ensure_tiny_model

            changes["model"] = ensure_tiny_model()
        port_file = self.workdir / f"{spec.name}.port"
        if port_file.exists():  # a restart: same address as before
            changes["port"] = int(port_file.read_text())
        self.spec = dataclasses.replace(spec, **changes)
        starts_file = self.workdir / f"{spec.name}.starts"
        self.starts = (int(starts_file.read_text()) if starts_file.exists() else 0) + 1
        starts_file.write_text(str(self.starts))
        self._launcher = Launcher(self.workdir / "logs")
        self.server: Server = self._start()
        port_file.write_text(str(self.server.port))
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "lorafleet.ray._reaper", str(os.getpid()), str(self.server.pid)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

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
            "node_id": ray.get_runtime_context().get_node_id(),
            "actor_pid": os.getpid(),
            "log_path": str(self.server.log_path),
            "starts": self.starts,
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

    def log_tail(self, n: int = 40) -> str:
        return self.server.proc.log_tail(n)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and its watchdog."""
        self._launcher.stop_all()
        if self._reaper.poll() is None:
            self._reaper.kill()
            self._reaper.wait()


class FleetRecord:
    """A named actor that remembers a fleet, so ``attach(namespace)`` needs no URL list."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record

    def get(self) -> dict[str, Any]:
        return self.record
