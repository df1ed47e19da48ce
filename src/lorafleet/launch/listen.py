"""Both ends of the listening-socket hand-off between the launcher and a server it starts.

The parent binds and listens (``bind_listener``), starts the child with the descriptor in
``pass_fds`` and closes its own copy; the child serves on it (``lorafleet engine|agent|router
--fd N`` call ``serve``). No port is probed, released and re-bound, so no other process can take
it in between.
"""

from __future__ import annotations

import contextlib
import socket
import sys
from typing import Any

import click

__all__ = [
    "api_key_option",
    "bind_listener",
    "control_token_option",
    "fd_option",
    "listen_address",
    "listen_options",
    "reserve_port",
    "serve",
    "tenants_option",
    "url_host",
]

# uvicorn's own exit status when the app never started (failed lifespan, bad config).
_STARTUP_FAILURE = 3

fd_option = click.option(
    "--fd",
    type=click.IntRange(min=0),
    default=None,
    help="Serve on this inherited listening socket; --host/--port are then ignored "
    "(the launcher binds the socket and passes it).",
)


def listen_options(port: int):
    """``--host`` (127.0.0.1), ``--port`` (``port``) and ``--fd``: where a server listens."""

    def decorate(f):
        f = fd_option(f)
        f = click.option("--port", default=port, show_default=True, type=int)(f)
        return click.option("--host", default="127.0.0.1", show_default=True)(f)

    return decorate


def control_token_option(help: str):
    """``--control-token`` (env ``LORAFLEET_CONTROL_TOKEN``): the fleet's control token."""
    return click.option(
        "--control-token", envvar="LORAFLEET_CONTROL_TOKEN", default=None, help=help
    )


def api_key_option(help: str, envvar: str = "LORAFLEET_API_KEY"):
    """``--api-key``: an inference key (never the control token)."""
    return click.option("--api-key", envvar=envvar, default=None, help=help)


def tenants_option(help: str):
    """``--tenants FILE``: the fleet's tenants file, read at start (``Tenants``, or None)."""

    def load(ctx: click.Context, param: click.Parameter, value: str | None):
        if value is None:
            return None
        from lorafleet.protocol.tenants import Tenants

        try:
            return Tenants.load(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx=ctx, param=param) from None

    return click.option(
        "--tenants",
        type=click.Path(dir_okay=False, exists=True),
        default=None,
        callback=load,
        help=help,
    )


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def url_host(host: str) -> str:
    """``host`` as it goes in a URL (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host else host


def bind_listener(host: str = "127.0.0.1", port: int = 0, *, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: any free port), to hand to a child.

    SO_REUSEADDR is set (``create_server`` does on POSIX), so a restart can bind the port its
    predecessor held while old connections sit in TIME_WAIT.
    """
    return socket.create_server((host, port), family=_family(host), backlog=backlog)


def reserve_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now, for a server that cannot take a socket (vLLM).

    Racy by nature: another process may bind it before the server does. The launcher retries
    such a server on a new port when it dies with "address already in use".
    """
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listen_address(host: str, port: int, fd: int | None) -> tuple[str, int]:
    """Where a server listens: the inherited socket's address with ``fd``, else host:port."""
    if fd is None:
        return host, port
    sock = socket.socket(fileno=fd)
    try:
        bound_host, bound_port = sock.getsockname()[:2]
    finally:
        sock.detach()  # the descriptor stays open for serve()
    return bound_host, bound_port


def serve(app: Any, *, host: str, port: int, fd: int | None, **config: Any) -> None:
    """Run ``app`` with uvicorn on the inherited socket ``fd``, or on host:port without one.

    ``config`` is passed to ``uvicorn.Config`` (log_level, loop, timeouts...).
    """
    import uvicorn

    if fd is None:
        uvicorn.run(app, host=host, port=port, **config)
        return
    # Not uvicorn.run(fd=...): it wraps the descriptor as AF_UNIX, so asyncio never sets
    # TCP_NODELAY on accepted connections and every small response waits for a delayed ACK
    # (measured: ~45 ms per request instead of ~5 ms). A socket built from the descriptor keeps
    # its real family. host/port only make uvicorn's "running on" line true.
    sock = socket.socket(fileno=fd)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, **config))
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[sock])
    if not server.started:
        sys.exit(_STARTUP_FAILURE)
