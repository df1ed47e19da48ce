"""``lorafleet dataplane``: data-plane copies of a router's control plane.

With ``--workers N`` this process binds (or inherits) one listening socket and runs N copies
on it, each its own process: the kernel spreads new connections over them, and one that dies is
started again (its requests in flight are the only ones lost). Several hosts each run this
behind a TCP balancer or a DNS name (docs/router.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import click

from lorafleet._settings import click_options, from_options
from lorafleet.dataplane.config import SERVER_OPTIONS, DataPlaneConfig
from lorafleet.launch.listen import (
    api_key_option,
    bind_listener,
    control_token_option,
    listen_address,
    listen_options,
    serve,
    tenants_option,
)
from lorafleet.protocol.tenants import Tenants

__all__ = ["command"]


@click.command("dataplane")
@click.option("--control", "control_url", required=True, help="The router (control plane) URL.")
@listen_options(8300)
@control_token_option("The control plane's token (env LORAFLEET_CONTROL_TOKEN).")
@api_key_option("Inference key clients send (env LORAFLEET_API_KEY); optional.")
@tenants_option(
    "A tenants file (TOML, or JSON): each tenant's token may name only its own adapters; read "
    "at start (docs/tenants.md)."
)
@click.option("--agent-token", default=None, help="Token to call agents (default: control token).")
@click.option("--copy-id", default=None, help="This copy's name at the control plane.")
@click_options(DataPlaneConfig)
@click.option("--log-level", default="warning", show_default=True)
def command(
    control_url: str,
    host: str,
    port: int,
    fd: int | None,
    control_token: str | None,
    api_key: str | None,
    tenants: Tenants | None,
    agent_token: str | None,
    copy_id: str | None,
    log_level: str,
    **options,
) -> None:
    """Serve generation by adapter version from a router's table, as data-plane copies."""
    host, port = listen_address(host, port, fd)
    config = from_options(
        DataPlaneConfig,
        options,
        control_url=control_url.rstrip("/"),
        control_token=control_token or None,
        agent_token=agent_token or control_token or None,
        api_key=api_key or None,
        tenants=tenants,
        url=f"http://{host}:{port}",
    )
    if config.workers > 1:
        _supervise(config, host, port, fd)
        return
    from lorafleet.dataplane.app import create_copy_app

    config.copy_id = copy_id or f"{host}:{port}#{os.getpid()}"
    serve(
        create_copy_app(config),
        host=host,
        port=port,
        fd=fd,
        log_level=log_level,
        **SERVER_OPTIONS,
    )


def _supervise(config: DataPlaneConfig, host: str, port: int, fd: int | None) -> None:
    """Run ``config.workers`` copies on one socket; start again any that exits."""
    if fd is None:
        sock = bind_listener(host, port)
        fd = sock.detach()
    # One worker: the same command on the shared descriptor (never --workers again).
    argv = _without(sys.argv[1:], ("--workers", "--fd", "--port", "--host"))
    base = [sys.executable, "-m", "lorafleet", *argv]
    base += ["--fd", str(fd)]
    children: dict[int, subprocess.Popen] = {}
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def spawn(slot: int) -> None:
        children[slot] = subprocess.Popen(base, pass_fds=(fd,))

    for slot in range(config.workers):
        spawn(slot)
    try:
        while not stopping:
            time.sleep(0.2)
            for slot, child in list(children.items()):
                if child.poll() is not None and not stopping:
                    click.echo(
                        f"data-plane copy {child.pid} exited with {child.returncode}: restarting",
                        err=True,
                    )
                    spawn(slot)
    finally:
        for child in children.values():
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + 10
        for child in children.values():
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` without ``options`` (each with its value, as ``--x v`` or ``--x=v``)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in options:
            skip = "=" not in a
            continue
        out.append(a)
    return out
