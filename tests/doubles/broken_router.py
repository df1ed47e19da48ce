"""A router with a deliberate time-of-check/time-of-use bug, to prove the consistency checker.

It tags and counts each request with the version active when it arrived, but re-reads the alias
table ``--resolve-at-forward`` seconds later and forwards to whatever is active then. Only the
tests run it (``start_broken_router``): ``python -m tests.doubles.broken_router
--resolve-at-forward 0.2 <router args>``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from dataclasses import dataclass

import click

from lorafleet.dataplane import plane
from lorafleet.dataplane.addressing import Route
from lorafleet.dataplane.balancer import Replica
from lorafleet.dataplane.pipeline import Pipeline
from lorafleet.launch import Launcher, Server
from lorafleet.router import cli as router_cli
from lorafleet.router.spec import RouterSpec
from tests.doubles import module_argv, spawn_env

__all__ = ["BrokenRouterSpec", "ResolveAtForwardPipeline", "command", "start_broken_router"]


class ResolveAtForwardPipeline(Pipeline):
    """Forwards to the version active ``delay`` seconds after arrival (the bug)."""

    def __init__(self, *args, delay: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay = delay

    async def _forward(self, call, shape, doc, route: Route, cands: list[Replica], stream):
        if route.adapter is not None:
            await asyncio.sleep(self.delay)
            entry = self.table.aliases.get(route.adapter)
            if entry is not None:
                route = dataclasses.replace(
                    route, engine_name=entry.engine_name, replicas=entry.replicas
                )
                cands = self.balancer.candidates(entry.replicas) or cands
        return await super()._forward(call, shape, doc, route, cands, stream)


def _serve(resolve_at_forward: float, **options) -> None:
    # The real router, its pipeline swapped for the broken one: the runtime has no seam for it.
    plane.Pipeline = functools.partial(ResolveAtForwardPipeline, delay=resolve_at_forward)
    router_cli.command.callback(**options)


command = click.Command(
    "broken-router",
    params=[
        *router_cli.command.params,
        click.Option(["--resolve-at-forward"], type=float, required=True),
    ],
    callback=_serve,
    help=__doc__,
)


@dataclass(frozen=True, kw_only=True)
class BrokenRouterSpec(RouterSpec):
    """``RouterSpec`` run as this module, forwarding ``resolve_at_forward`` s after arrival."""

    resolve_at_forward: float
    name: str = "broken-router"

    def argv(self, fd: int) -> list[str]:
        argv = module_argv(__name__, super().argv(fd), "router")
        return [*argv, "--resolve-at-forward", str(self.resolve_at_forward)]

    def environ(self) -> dict[str, str]:
        return {**super().environ(), **spawn_env()}


def start_broken_router(
    launcher: Launcher,
    agents: list[Server],
    *,
    token: str,
    resolve_at_forward: float,
    health_interval: float | None = None,
) -> Server[BrokenRouterSpec]:
    """The broken router over ``agents``, ready on /health."""
    return launcher.start(
        BrokenRouterSpec(
            agents=tuple(a.url for a in agents),
            token=token,
            health_interval=health_interval,
            resolve_at_forward=resolve_at_forward,
        )
    )


if __name__ == "__main__":
    command()
