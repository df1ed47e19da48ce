"""A router with a deliberate time-of-check/time-of-use bug, to prove the consistency checker.

It tags and counts each request with the version active when it arrived, but re-reads the alias
table ``--resolve-at-forward`` seconds later and forwards to whatever is active then. Only the
tests run it: ``python -m lorafleet.testing.broken_router --resolve-at-forward 0.2 <router args>``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools

import click

from lorafleet.router import cli as router_cli
from lorafleet.router.balancer import Replica
from lorafleet.router.proxy import Proxy, Route

__all__ = ["ResolveAtForwardProxy", "command"]


class ResolveAtForwardProxy(Proxy):
    """Forwards to the version active ``delay`` seconds after arrival (the bug)."""

    def __init__(self, *args, delay: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay = delay

    async def _forward(self, scope, send, route: Route, path, req, raw, cands: list[Replica],
                       session, **kw) -> int:  # fmt: skip
        if route.adapter is not None:
            await asyncio.sleep(self.delay)
            entry = self.store.aliases.get(route.adapter)
            if entry is not None:
                route = dataclasses.replace(
                    route, engine_name=entry.engine_name, replicas=entry.replicas
                )
                cands = self.balancer.candidates(entry.replicas) or cands
        return await super()._forward(scope, send, route, path, req, raw, cands, session, **kw)


def _serve(resolve_at_forward: float, **options) -> None:
    proxy = functools.partial(ResolveAtForwardProxy, delay=resolve_at_forward)
    router_cli.command.callback(**options, proxy_class=proxy)


command = click.Command(
    "broken-router",
    params=[
        *router_cli.command.params,
        click.Option(["--resolve-at-forward"], type=float, required=True),
    ],
    callback=_serve,
    help=__doc__,
)

if __name__ == "__main__":
    command()
