"""Start and stop local server processes: used by ``lorafleet up``, the demo, tests and benches."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

__all__ = ["ManagedProcess", "free_port", "lorafleet_argv"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def lorafleet_argv(*args: str) -> list[str]:
    """argv that runs ``lorafleet ARGS`` with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-m", "lorafleet", *args]


class ManagedProcess:
    """A child process in its own session, stopped with its whole process group.

    ``wait_ready`` polls ``ready_url`` until it answers 200 (or ``ready_status``), and fails early
    with the tail of the log if the process exits first.
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
    ) -> None:
        self.argv = list(argv)
        self.ready_url = ready_url
        self.name = name or Path(self.argv[0]).name
        self.log_path = Path(log_path) if log_path else None
        full_env = dict(os.environ)
        full_env.update(env or {})
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        else:
            self._log = subprocess.DEVNULL
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def wait_ready(self, timeout: float = 60.0, ready_status: int = 200) -> ManagedProcess:
        if not self.ready_url:
            return self
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} before it was ready:\n"
                    + self.log_tail()
                )
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

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, for tests)."""
        self.signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the group, then SIGKILL whatever is left after ``timeout``."""
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        # Children may outlive the leader (vLLM's engine core); sweep the group regardless.
        self.signal(signal.SIGKILL)
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
