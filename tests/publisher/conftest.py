"""A real fleet on loopback for publisher tests: reference engines, agents and a router."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from lorafleet.testing import Server, start_agent, start_reference_engine, start_router


@dataclass
class Fleet:
    engines: list[Server]
    agents: list[Server]
    router: Server | None
    token: str
    procs: object = field(repr=False, default=None)

    @property
    def agent_urls(self) -> list[str]:
        return [a.url for a in self.agents]

    def staging_bytes(self) -> list[int]:
        out = []
        for a in self.agents:
            total = 0
            for dirpath, _, files in os.walk(Path(a.data_dir) / "staging"):
                total += sum((Path(dirpath) / f).stat().st_size for f in files)
            out.append(total)
        return out

    def adapters(self, i: int) -> list[dict]:
        r = httpx.get(
            f"{self.agents[i].url}/v1/adapters",
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=10,
        )
        r.raise_for_status()
        return r.json()["adapters"]

    def engine_models(self, i: int) -> set[str]:
        r = httpx.get(f"{self.engines[i].url}/v1/models", timeout=10)
        return {m["id"] for m in r.json()["data"]}

    def restart_agent(self, i: int) -> Server:
        old = self.agents[i]
        old.proc.stop()
        self.agents[i] = start_agent(
            self.procs, self.engines[i], old.data_dir, token=self.token, port=old.port
        )
        return self.agents[i]


@pytest.fixture
def make_fleet(procs, tiny_model, tmp_path):
    """``make_fleet(n=2, ranks=None, router=True)``: a fresh fleet of real processes."""

    def make(n: int = 2, ranks: list[int] | None = None, router: bool = True, shared=None) -> Fleet:
        token = secrets.token_urlsafe(12)
        ranks = ranks or [64] * n
        engines = [start_reference_engine(procs, tiny_model, max_lora_rank=r) for r in ranks]
        agents = [
            start_agent(
                procs,
                e,
                tmp_path / f"agent{i}",
                token=token,
                extra=["--max-lora-rank", str(ranks[i])]
                + (["--shared-fs-allow", str(shared)] if shared else []),
            )
            for i, e in enumerate(engines)
        ]
        rt = None
        if router:
            rt = start_router(
                procs, agents, tmp_path / "router", token=token, extra=["--health-interval", "0.2"]
            )
        return Fleet(engines=engines, agents=agents, router=rt, token=token, procs=procs)

    return make
