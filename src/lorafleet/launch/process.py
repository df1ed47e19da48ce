"""``ManagedProcess``: one child in its own session, stopped with its whole process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

import httpx

from lorafleet.launch import forkserver

__all__ = ["ManagedProcess", "ProcessExited", "lorafleet_argv"]


def lorafleet_argv(*args: str) -> list[str]:
    """argv that runs ``lorafleet ARGS`` with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-m", "lorafleet", *args]


class ProcessExited(RuntimeError):
    """The process exited before it was ready; the message carries the tail of its log."""

    def __init__(self, name: str, returncode: int | None, log_tail: str) -> None:
        super().__init__(f"{name} exited with {returncode} before it was ready:\n{log_tail}")
        self.returncode = returncode
        self.log_tail = log_tail


class ManagedProcess:
    """A child process in its own session, stopped with its whole process group.

    Output goes to ``log_path`` (appended: a restart keeps its predecessor's lines). ``wait_ready``
    polls ``ready_url`` until it answers ``ready_status`` and fails early, with the tail of this
    run's log, if the process exits first. ``pass_fds`` are inherited by the child (listening
    sockets); every other descriptor is closed in it. ``term_group=False`` sends the polite
    SIGTERM of ``stop`` to the leader only, for a server that stops its own children (SGLang
    reads a SIGTERM that reaches its scheduler first as a crash); the group is swept with
    SIGKILL afterwards either way.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        ready_url: str | None = None,
        log_path: str | os.PathLike | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        name: str | None = None,
        pass_fds: Collection[int] = (),
        term_group: bool = True,
    ) -> None:
        self.argv = list(argv)
        self.term_group = term_group
        self.ready_url = ready_url
        self.name = name or Path(self.argv[0]).name
        self.log_path = Path(log_path) if log_path else None
        full_env = dict(os.environ)
        full_env.update(env or {})
        self._log_start = 0
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
            self._log_start = self._log.tell()
        else:
            self._log = subprocess.DEVNULL
        self.proc = _start(self.argv, self._log, full_env, cwd, tuple(pass_fds))

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        """What this run (not a predecessor on the same log file) has written so far."""
        if not self.log_path or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(self._log_start)
            return f.read().decode(errors="replace")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def wait_ready(self, timeout: float = 60.0, ready_status: int = 200) -> ManagedProcess:
        """Poll ``ready_url``; raise ``ProcessExited`` or (after stopping it) ``TimeoutError``."""
        if not self.ready_url:
            return self
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if not self.alive():
                raise ProcessExited(self.name, self.proc.returncode, self.log_tail())
            try:
                r = httpx.get(self.ready_url, timeout=2.0)
                if r.status_code == ready_status:
                    return self
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(
            f"{self.name} not ready at {self.ready_url} after {timeout}s ({last}):\n"
            + self.log_tail()
        )

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to exit on its own; its exit status."""
        return self.proc.wait(timeout)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, for tests)."""
        self.signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the group (or the leader), then SIGKILL whatever is left after ``timeout``.
        Idempotent."""
        if self.alive():
            if self.term_group:
                self.signal(signal.SIGTERM)
            else:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        # Children may outlive the leader (vLLM's engine core); sweep the group regardless.
        self.signal(signal.SIGKILL)
        if self._log is not subprocess.DEVNULL and not self._log.closed:
            self._log.close()

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _start(
    argv: list[str],
    log: BinaryIO | int,
    env: dict[str, str],
    cwd: str | os.PathLike | None,
    pass_fds: tuple[int, ...],
) -> subprocess.Popen | forkserver.ForkedProcess:
    """A fork of the fork server in use that serves ``argv`` (see ``forkserver``), else a new
    process, in its own session either way."""
    server = forkserver.server_for(argv)
    if server is not None:
        log_fd = None if isinstance(log, int) else log.fileno()
        with contextlib.suppress(forkserver.ForkRefused):
            return server.spawn(argv, env=env, cwd=cwd, log_fd=log_fd, pass_fds=pass_fds)
    return subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=cwd,
        start_new_session=True,
        pass_fds=pass_fds,
    )
