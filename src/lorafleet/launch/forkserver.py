"""A fork server: servers started as forks of one process that imported their modules once.

A reference engine spends 10 CPU-seconds importing torch, transformers and peft before it
serves; an agent or a router 2-3 s importing its web stack. A test session starts hundreds of
them on a small machine. A ``ForkServer`` imports a module list once, then forks each
``lorafleet <command>`` it is asked for from that state: the child starts a new session,
takes the requester's environment, working directory, log and listening sockets, and runs the
command as ``python -m lorafleet`` would. To its launcher it is a ``ForkedProcess``, which acts
as the ``subprocess.Popen`` it replaces (pid, poll, wait, signals, exit status).

Opt-in and process-local: ``use(server)`` makes this process's ``ManagedProcess`` fork the
server's commands; processes it starts do not inherit that. What the server cannot reproduce it
refuses, and the caller starts the command the usual way:

- an interpreter other than the server's, or argv other than ``python -m lorafleet COMMAND``;
- an environment that differs from the server's in a variable the preloaded modules read at
  import time (``HF_*``, ``TORCH*``, ``OMP_*``...): those values are already fixed in them.

The server must stay single-threaded until it forks (a fork copies one thread, and any lock
another held stays held). It checks that after its imports and refuses to start otherwise.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import fcntl
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from lorafleet.fleetfile import pid_alive

__all__ = [
    "ENGINE_PRELOAD",
    "SERVICE_COMMANDS",
    "SERVICE_PRELOAD",
    "ForkRefused",
    "ForkServer",
    "ForkedProcess",
    "use",
]

SERVICE_COMMANDS: tuple[str, ...] = ("agent", "router", "front", "dataplane")

SERVICE_PRELOAD: tuple[str, ...] = (
    "lorafleet.cli",
    "lorafleet.launch.listen",
    "lorafleet._dirlock",
    "lorafleet.agent.app",
    "lorafleet.agent._body",
    "lorafleet.router.app",
    "lorafleet.front.app",
    "lorafleet.dataplane.app",
    "uvicorn.protocols.http.h11_impl",
    "uvicorn.lifespan.on",
    "uvicorn.loops.asyncio",
)
"""What ``lorafleet agent|router|front|dataplane`` import before they serve (no torch)."""

ENGINE_PRELOAD: tuple[str, ...] = (
    "torch",
    "transformers:AutoModelForCausalLM",
    "transformers:AutoTokenizer",
    "transformers.models.llama.modeling_llama",
    "peft:PeftModel",
    "lorafleet.engine._runtime",
    "lorafleet.engine.app",
    *SERVICE_PRELOAD,
)
"""What ``lorafleet engine`` imports before it serves (torch, transformers, peft)."""

# Variables read while the interpreter starts or a preloaded module is imported: a child whose
# value differs would run with the server's, so such a request is refused. A library's own
# variables count only where the server imported it (a child that imports torch itself reads
# TORCH* then); others (Ray's PYTHONBREAKPOINT in a driver, a test's settings) are read at run
# time and pass.
_IMPORT_TIME_PREFIXES: dict[str, tuple[str, ...]] = {
    "huggingface_hub": ("HF_", "HUGGINGFACE_"),
    "transformers": ("TRANSFORMERS_",),
    "tokenizers": ("TOKENIZERS_",),
    "torch": ("TORCH", "PYTORCH_", "OMP_", "MKL_", "KMP_", "CUDA"),
}
_INTERPRETER_ENV = frozenset({
    "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONIOENCODING",
    "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", "PYTHONOPTIMIZE", "PYTHONSAFEPATH", "PYTHONUTF8",
    "PYTHONDEVMODE", "PYTHONFAULTHANDLER", "PYTHONTRACEMALLOC", "PYTHONMALLOC", "PYTHONNOUSERSITE",
    "PYTHONUSERBASE", "PYTHONPLATLIBDIR", "PYTHONINTMAXSTRDIGITS", "PYTHONPYCACHEPREFIX",
    "PYTHONVERBOSE", "PYTHONDEBUG", "PYTHONINSPECT", "PYTHONSTARTUP", "PYTHONCASEOK",
})  # fmt: skip
_HEADER = struct.Struct("!I")
_MAX_REQUEST = 4 << 20
_MAX_FDS = 16


class ForkRefused(RuntimeError):
    """The server cannot start this command as asked; start it the usual way."""


# -- client side ------------------------------------------------------------------------------


class ForkedProcess:
    """A child of the fork server, handled as the ``subprocess.Popen`` it stands in for.

    Its exit status comes over the connection the request was made on: the server, its
    parent, reaps it and writes the status there.
    """

    def __init__(self, conn: socket.socket, pid: int, args: Sequence[str]) -> None:
        self._conn = conn
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        """The exit status if the process has ended, else None."""
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit status; ``subprocess.TimeoutExpired`` after ``timeout``."""
        if self._read(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, timeout: float | None) -> int | None:
        # As Popen: while another thread waits for the status, a poll answers "still running"
        # rather than queueing behind it.
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return self.returncode
        try:
            if self.returncode is not None:
                return self.returncode
            self._conn.settimeout(timeout)
            try:
                line = _recv_line(self._conn)
            except (TimeoutError, BlockingIOError):
                return None
            except OSError:
                line = b""
            if line:
                self.returncode = int(json.loads(line)["returncode"])
            else:
                # The server is gone without a word: its orphans were re-parented and are
                # reaped elsewhere, so only whether the pid still runs can be known.
                if pid_alive(self.pid):
                    return None
                self.returncode = -signal.SIGKILL
            self._conn.close()
            return self.returncode
        finally:
            self._lock.release()


class ForkServer:
    """A running fork server: start it, ``use`` it, ``stop`` it (or use it as a context).

    ``commands`` are the ``lorafleet`` subcommands it forks; ``preload`` what it imports first
    (``"module"`` or ``"module:attribute"``, for packages that load lazily).
    """

    def __init__(
        self,
        commands: Collection[str],
        preload: Sequence[str],
        *,
        log_path: str | os.PathLike | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.commands = frozenset(commands)
        self.preload = tuple(preload)
        self._dir = tempfile.mkdtemp(prefix="lorafleet-forkserver-")
        self.path = os.path.join(self._dir, "sock")
        self.env = dict(os.environ if env is None else env)
        log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        # Not ``-m``: this module is already imported (as lorafleet.launch's) when it would run.
        argv = [sys.executable, "-c", "from lorafleet.launch.forkserver import main; main()"]
        self.proc = subprocess.Popen(
            [*argv, self.path, *self.preload],
            stdin=subprocess.PIPE,  # closed when this process ends: the server then ends too
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        if log is not subprocess.DEVNULL:
            log.close()
        self._ready = False
        self.forked = 0
        self.refused: collections.Counter[str] = collections.Counter()
        """Why requests were refused, and how often (each was started the usual way)."""

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Wait until it has imported its modules and listens."""
        deadline = time.monotonic() + timeout
        while not self._ready:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the fork server exited with {self.proc.returncode}")
            if os.path.exists(self.path):
                self._ready = True
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the fork server was not ready after {timeout}s")
            time.sleep(0.05)

    def serves(self, argv: Sequence[str]) -> bool:
        """Whether ``argv`` is a command this server forks (``python -m lorafleet COMMAND``)
        for the calling thread: a thread moved into another network namespace (the netbed's
        replicas) starts its children there, which a fork of the server would not be."""
        return (
            len(argv) > 3
            and argv[0] == sys.executable
            and list(argv[1:3]) == ["-m", "lorafleet"]
            and argv[3] in self.commands
            and self.proc.poll() is None
            and _namespaces("thread-self") == _namespaces(str(self.proc.pid))
        )

    def spawn(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | os.PathLike | None = None,
        log_fd: int | None = None,
        pass_fds: Collection[int] = (),
    ) -> ForkedProcess:
        """Fork ``argv`` (``python -m lorafleet COMMAND ...``); ``ForkRefused`` if it cannot,
        a server that failed or went away included: the caller starts it the usual way."""
        try:
            self.wait_ready()
        except (RuntimeError, TimeoutError) as exc:
            raise ForkRefused(str(exc)) from exc
        request = {
            "argv": list(argv[3:]),
            "env": dict(env),
            "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "log": log_fd is not None,
            "targets": list(pass_fds),
        }
        fds = ([] if log_fd is None else [log_fd]) + list(pass_fds)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(30.0)
            conn.connect(self.path)
            _send_message(conn, json.dumps(request).encode(), fds)
            answer = json.loads(_recv_line(conn) or b'{"error": "the fork server closed"}')
        except OSError as exc:
            conn.close()
            raise ForkRefused(f"the fork server did not answer: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        if "error" in answer:
            conn.close()
            self.refused[answer["error"]] += 1
            raise ForkRefused(answer["error"])
        self.forked += 1
        return ForkedProcess(conn, int(answer["pid"]), argv)

    def stop(self) -> None:
        """Stop the server (its children keep running: they are their launchers')."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdin:
            self.proc.stdin.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)
        _servers[:] = [s for s in _servers if s is not self]

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_servers: list[ForkServer] = []


def use(server: ForkServer) -> None:
    """Make this process's ``ManagedProcess`` fork ``server``'s commands from now on."""
    _servers.append(server)


def server_for(argv: Sequence[str]) -> ForkServer | None:
    """The server in use that forks ``argv``, if any."""
    return next((s for s in _servers if s.serves(argv)), None)


def _import_time_prefixes() -> tuple[str, ...]:
    """The variable prefixes of the libraries this process has imported, and the loader's."""
    loaded = [p for m, ps in _IMPORT_TIME_PREFIXES.items() if m in sys.modules for p in ps]
    return ("LD_", *loaded)


def _differing(
    env: Mapping[str, str],
    started: Mapping[str, str],
    imported: Mapping[str, str],
    prefixes: tuple[str, ...],
) -> list[str]:
    """The variables of ``env`` that were read at start or import time (``prefixes``, the
    interpreter's own) and that the server saw otherwise: neither the value it started with nor
    one its imports set themselves."""
    keys = {k for k in (*env, *started) if k.startswith(prefixes) or k in _INTERPRETER_ENV}
    return sorted(k for k in keys if env.get(k) not in (started.get(k), imported.get(k)))


def _namespaces(process: str) -> list[str]:
    """The namespaces (network, mount...) that ``/proc/<process>`` runs in."""
    out = []
    for kind in ("net", "mnt", "uts", "ipc", "user", "cgroup"):
        try:
            out.append(os.readlink(f"/proc/{process}/ns/{kind}"))
        except OSError:
            out.append("")
    return out


def _send_message(sock: socket.socket, data: bytes, fds: Sequence[int]) -> None:
    payload = _HEADER.pack(len(data)) + data
    sent = socket.send_fds(sock, [payload], list(fds))
    if sent < len(payload):
        sock.sendall(payload[sent:])


def _recv_message(sock: socket.socket) -> tuple[bytes, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(sock, 65536, _MAX_FDS)
    try:
        if len(data) < _HEADER.size:
            raise ValueError("a short request")
        (size,) = _HEADER.unpack_from(data)
        if size > _MAX_REQUEST:
            raise ValueError("an oversized request")
        body = data[_HEADER.size :]
        while len(body) < size:
            chunk = sock.recv(size - len(body))
            if not chunk:
                raise ValueError("a truncated request")
            body += chunk
        return body, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _recv_line(sock: socket.socket) -> bytes:
    """One newline-terminated answer (b"" at end of stream); read a byte at a time, so nothing
    after it is consumed."""
    out = bytearray()
    while True:
        b = sock.recv(1)
        if not b:
            return b""
        if b == b"\n":
            return bytes(out)
        out += b


# -- server side ------------------------------------------------------------------------------


def _preload(names: Sequence[str]) -> None:
    for name in names:
        module, _, attribute = name.partition(":")
        loaded = importlib.import_module(module)
        if attribute:
            getattr(loaded, attribute)


def _child(request: dict, fds: list[int], started: int) -> None:
    """In the forked child: become the requested command. Never returns."""
    code = 1
    try:
        os.setsid()
        os.write(started, b"s")  # the pid is now a group's too: killpg on it reaches us
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # Move what was received out of the way, then onto the numbers the command expects.
        high = [_dup_high(fd) for fd in fds]
        log = high.pop(0) if request["log"] else None
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(log if log is not None else null, 1)
        os.dup2(log if log is not None else null, 2)
        keep = {0, 1, 2}
        for fd, target in zip(high, request["targets"], strict=True):
            os.dup2(fd, target, inheritable=True)
            keep.add(target)
        for fd in _open_fds():
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["lorafleet", *request["argv"]]
        import runpy

        try:
            runpy.run_module("lorafleet", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except BaseException:
            traceback.print_exc()
            code = 1
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _dup_high(fd: int) -> int:
    # Above any number a command expects its sockets at, so that placing one cannot
    # overwrite another that is still to be placed.
    new = fcntl.fcntl(fd, fcntl.F_DUPFD, 1024)
    os.close(fd)
    return new


def _open_fds() -> list[int]:
    return [int(name) for name in os.listdir("/proc/self/fd")]


def _serve(path: str, preload: Sequence[str]) -> None:
    # As started, before the imports (torch's set some variables): what the client compares.
    started = dict(os.environ)
    _preload(preload)
    imported = dict(os.environ)
    prefixes = _import_time_prefixes()
    if threading.active_count() != 1:
        names = [t.name for t in threading.enumerate()]
        raise SystemExit(f"fork server: threads were started by the imports: {names}")
    gc.collect()
    gc.freeze()  # what is loaded now stays shared with every child instead of being copied
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.chmod(path + ".tmp", 0o600)
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the path appears once it accepts: the client's readiness
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")
    while True:
        for key, _ in selector.select():
            if key.data == "parent":
                if not os.read(sys.stdin.fileno(), 4096):
                    return  # the process that started us is gone
            elif key.data == "child":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
            elif key.data == "accept":
                conn, _ = listener.accept()
                _answer(conn, (started, imported, prefixes), children)
        _reap(children)


def _answer(
    conn: socket.socket,
    seen: tuple[dict[str, str], dict[str, str], tuple[str, ...]],
    children: dict[int, socket.socket],
) -> None:
    conn.settimeout(10.0)
    fds: list[int] = []
    try:
        body, fds = _recv_message(conn)
        request = json.loads(body)
        different = _differing(request["env"], *seen)
        if different:
            raise ForkRefused(f"{different[0]} differs from the fork server's environment")
    except (OSError, ValueError, KeyError, ForkRefused) as exc:
        for fd in fds:
            os.close(fd)  # the caller's listening socket among them: its port must be free
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"error": str(exc)}).encode() + b"\n")
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    started_r, started_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _child(request, fds, started_w)
    os.close(started_w)
    os.read(started_r, 1)  # b"" if it died first: then the reply below still names it
    os.close(started_r)
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    except OSError:
        os.kill(pid, signal.SIGKILL)  # nobody will manage it
    children[pid] = conn


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                code = os.waitstatus_to_exitcode(status)
                conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")
            conn.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lorafleet.launch.forkserver")
    parser.add_argument("path", help="the Unix socket to listen on")
    parser.add_argument("preload", nargs="*", help="modules to import first (module[:attr])")
    args = parser.parse_args(argv)
    try:
        _serve(args.path, args.preload)
    finally:
        with contextlib.suppress(OSError):
            Path(args.path).unlink()


if __name__ == "__main__":
    main()
