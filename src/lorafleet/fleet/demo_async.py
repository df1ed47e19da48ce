"""``lorafleet demo --async``: training and rollouts overlap, as in asynchronous RL.

The trainer publishes after every step while rollout workers keep generating through the router.
Each rollout is a short episode (a session of two turns, ``X-Session-ID``): it stays on the
version it started on, and every response says which version that is. The name keeps a
retention window of ``K`` versions with a staleness bound ``S``; the live table shows, per
step, how far behind the newest version the served rollouts were (the router's own
``lorafleet_router_version_lag`` histogram). The run fails if any request failed or any sample
came from outside the window.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lorafleet.fleet.config import FleetConfig
from lorafleet.fleet.local import LocalFleet
from lorafleet.fleet.skill import PROMPT, TrainSettings, reward
from lorafleet.protocol.router import SESSION_HEADER

__all__ = ["AsyncDemoSummary", "run_async_demo"]

ADAPTER = "policy"
KEEP = 3
STALENESS = 2
SETTINGS = TrainSettings(rank=8, alpha=16, lr=3e-3, seed=1)
WORKERS = 2


@dataclass
class StepRow:
    step: int
    version: int
    loss: float
    publish_s: float
    rollouts: int
    """Rollout turns served since the previous step."""
    lag_max: int | None
    lag_mean: float | None
    reward_mean: float | None
    failed: int


@dataclass
class AsyncDemoSummary:
    ok: bool
    steps: list[StepRow]
    rollouts: int
    failed: int
    switched: int
    """Episodes whose turns came from two versions (must be 0: sessions pin their version)."""
    max_lag: int | None
    keep_versions: int = KEEP
    max_staleness: int = STALENESS
    wall_s: float = 0.0
    failures: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class _Rollouts:
    """Episodes through the router, on worker threads, until stopped."""

    def __init__(self, fleet: LocalFleet, max_tokens: int) -> None:
        headers = {"Authorization": f"Bearer {fleet.api_key}"} if fleet.api_key else {}
        self.url, self.headers, self.max_tokens = fleet.router_url, headers, max_tokens
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.samples: list[tuple[int | None, float, int]] = []
        """(served version, reward, status) per turn."""
        self.switched = 0
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="rollout")
        self._futures: list = []

    def start(self) -> None:
        self._futures = [self._pool.submit(self._work, w) for w in range(WORKERS)]

    def _work(self, worker: int) -> None:
        body = {"model": ADAPTER, "prompt": PROMPT, "max_tokens": self.max_tokens}
        body["temperature"] = 0
        with httpx.Client(base_url=self.url, timeout=60) as client:
            episode = 0
            while not self.stop.is_set():
                episode += 1
                session = {**self.headers, SESSION_HEADER: f"w{worker}-e{episode}"}
                versions = set()
                for _ in range(2):
                    r = client.post("/v1/completions", json=body, headers=session)
                    version, score = None, 0.0
                    if r.status_code == 200:
                        out = r.json()
                        version = out["lorafleet"]["version"]
                        score = reward(out["choices"][0]["text"].replace("\ufffd", ""))
                        versions.add(version)
                    with self.lock:
                        self.samples.append((version, score, r.status_code))
                with self.lock:
                    self.switched += len(versions) > 1
                client.post("/finish_session", params={"session_id": session[SESSION_HEADER]},
                            headers=self.headers)  # fmt: skip

    def take(self) -> list[tuple[int | None, float, int]]:
        with self.lock:
            out, self.samples = self.samples, []
        return out

    def close(self) -> None:
        self.stop.set()
        for f in self._futures:
            with contextlib.suppress(Exception):
                f.result(timeout=120)
        self._pool.shutdown(wait=True)


def _lag_counts(router_url: str) -> dict[float, float]:
    """The router's version-lag histogram for the demo's name: bucket bound -> cumulative count."""
    text = httpx.get(router_url + "/metrics", timeout=10).text
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "lorafleet_router_version_lag":
            continue
        for s in family.samples:
            if s.name.endswith("_bucket") and s.labels.get("adapter") == ADAPTER:
                out[float(s.labels["le"])] = s.value
    return out


def _lag_since(before: dict[float, float], after: dict[float, float]) -> tuple[int | None, float]:
    """(max lag, mean lag) of the requests counted between two histogram readings."""
    bounds = sorted(b for b in after if b != float("inf"))
    counts, prev = {}, 0.0
    for b in bounds:
        cum = after.get(b, 0.0) - before.get(b, 0.0)
        counts[int(b)] = cum - prev
        prev = cum
    n = sum(counts.values())
    if not n:
        return None, 0.0
    return max(b for b, c in counts.items() if c), sum(b * c for b, c in counts.items()) / n


def run_async_demo(*, steps: int, data_dir: str | Path | None = None, console: Any = None):
    """Run the asynchronous demo end to end; its summary (``ok``: no failure, all in window)."""
    from rich.console import Console

    from lorafleet.fleet.demo import _quiet_hf

    _quiet_hf()
    console = console or Console(width=None if sys.stdout.isatty() else 120)
    t0 = time.monotonic()
    own = data_dir is None
    root = Path(tempfile.mkdtemp(prefix="lorafleet-demo-async-")) if own else Path(data_dir)
    summary = None
    try:
        summary = _run(console, steps=steps, root=root, t0=t0)
        return summary
    finally:
        if own and summary is not None and summary.ok:
            shutil.rmtree(root, ignore_errors=True)
        elif own:
            console.print(f"[dim]fleet logs kept in {root / 'logs'}[/dim]")


def _run(console: Any, *, steps: int, root: Path, t0: float) -> AsyncDemoSummary:
    from rich.table import Table

    from lorafleet.fleet.skill import SkillTrainer
    from lorafleet.publisher import Publisher
    from lorafleet.tinymodel import ensure_tiny_model

    console.print(
        f"[bold]lorafleet demo --async[/bold]: rollouts never stop while the trainer publishes "
        f"every step; window K={KEEP}, staleness S={STALENESS}"
    )
    fleet = LocalFleet(FleetConfig.default(engines=2, data_dir=root),
                       on_event=lambda m: console.print(f"[dim]{m}[/dim]"))  # fmt: skip
    rows: list[StepRow] = []
    failures: list[str] = []
    try:
        # The fleet's processes and the trainer's model load overlap; both take seconds.
        with ThreadPoolExecutor(1) as pool:
            started = pool.submit(fleet.start)
            trainer = SkillTrainer(ensure_tiny_model(), SETTINGS)
            started.result()
        with Publisher(fleet.agent_urls, router=fleet.router_url, token=fleet.token) as pub:
            window = {"keep_versions": KEEP, "max_staleness": STALENESS}
            pub.publish(trainer.model, name=ADAPTER, **window)  # v1: rollouts need a policy
            rollouts = _Rollouts(fleet, trainer.max_new_tokens)
            rollouts.start()
            before = _lag_counts(fleet.router_url)
            try:
                for step in range(1, steps + 1):
                    loss = trainer.train_step()
                    t = time.perf_counter()
                    result = pub.publish(trainer.model, name=ADAPTER, **window)
                    publish_s = time.perf_counter() - t
                    after = _lag_counts(fleet.router_url)
                    lag_max, lag_mean = _lag_since(before, after)
                    before = after
                    samples = rollouts.take()
                    scores = [s for v, s, code in samples if code == 200]
                    rows.append(
                        StepRow(
                            step=step,
                            version=result.version,
                            loss=loss,
                            publish_s=publish_s,
                            rollouts=len(samples),
                            lag_max=lag_max,
                            lag_mean=lag_mean,
                            reward_mean=sum(scores) / len(scores) if scores else None,
                            failed=sum(1 for _, _, code in samples if code != 200),
                        )
                    )
                    r = rows[-1]
                    console.print(
                        f"step {step:>2} published v{r.version} loss={loss:.3f} "
                        f"publish={publish_s * 1000:.0f}ms rollouts={r.rollouts} "
                        f"lag max={r.lag_max} mean={r.lag_mean:.2f} "
                        f"reward={'-' if r.reward_mean is None else f'{r.reward_mean:.2f}'} "
                        f"failed={r.failed}",
                        highlight=False,
                    )
            finally:
                rollouts.close()
            tail = rollouts.take()
    finally:
        fleet.stop()
    failed = sum(r.failed for r in rows) + sum(1 for _, _, c in tail if c != 200)
    lags = [r.lag_max for r in rows if r.lag_max is not None]
    max_lag = max(lags) if lags else None
    total = sum(r.rollouts for r in rows) + len(tail)
    if failed:
        failures.append(f"{failed} rollout request(s) failed")
    if max_lag is not None and max_lag > STALENESS:
        failures.append(f"a sample was served {max_lag} versions behind (S={STALENESS})")
    if rollouts.switched:
        failures.append(f"{rollouts.switched} episode(s) switched version mid-way")
    if not total:
        failures.append("no rollout was served")
    table = Table(title="async summary", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("rollout turns served", str(total))
    table.add_row("failed requests", str(failed))
    table.add_row("episodes that switched version", str(rollouts.switched))
    table.add_row("largest served-version lag", f"{max_lag} (window {KEEP}, S={STALENESS})")
    console.print(table)
    for f in failures:
        console.print(f"[bold red]FAIL[/]: {f}")
    if not failures:
        console.print("[bold green]OK[/]: every rollout came from inside the window")
    return AsyncDemoSummary(
        ok=not failures,
        steps=rows,
        rollouts=total,
        failed=failed,
        switched=rollouts.switched,
        max_lag=max_lag,
        wall_s=time.monotonic() - t0,
        failures=failures,
    )
