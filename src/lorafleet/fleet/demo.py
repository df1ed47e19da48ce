"""``lorafleet demo``: train on CPU, publish every step, measure the reward through the router.

The reward is read from what the *fleet* serves (greedy, ``model=<adapter name>``), never from the
trainer, so the curve rises only if every publish really reached every replica and the router
flipped to it. ``--resume`` kills the engines mid-run, replaces the agents with empty ones (new
nodes), restarts the trainer from a native-only checkpoint and shows that the first publish
restores serving exactly (DESIGN promise 7, seed 004).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from lorafleet.fleet.config import FleetConfig
from lorafleet.fleet.local import LocalFleet
from lorafleet.fleet.skill import PROMPT, TARGET, TrainSettings, reward

__all__ = ["DemoSummary", "StepRecord", "run_demo"]

ADAPTER = "policy"
DEFAULT_STEPS = 12
# Seed 1 climbs over several steps (0.08 → 0.23 → 0.35 → 0.52 → 1.0) instead of jumping, so the
# resume point in the middle of the run sits visibly mid-curve.
DEMO_SETTINGS = TrainSettings(rank=8, alpha=16, lr=3e-3, seed=1)
SUCCESS_REWARD = 0.9


@dataclass
class StepRecord:
    step: int
    phase: str
    """"train": a training step then a publish from memory; "restore": the first publish after the
    restart, from the native checkpoint (state dict + config dict)."""
    loss: float | None
    version: int | None
    publish_s: float | None
    reward: float
    output: str
    served_version: int | None
    trainer_output: str | None = None


def _measure(router, trainer, step: int, phase: str, loss, result, publish_s: float) -> StepRecord:
    """Greedy answer through the router right after a publish, scored against the target."""
    output, served = router.complete(ADAPTER)
    return StepRecord(
        step=step,
        phase=phase,
        loss=loss,
        version=result.version,
        publish_s=publish_s,
        reward=reward(output),
        output=output,
        served_version=served,
        trainer_output=_clean(trainer.greedy()),
    )


@dataclass
class DemoSummary:
    ok: bool
    steps: list[StepRecord]
    base_output: str
    base_reward: float
    final_output: str
    final_reward: float
    publish_p50_s: float
    publish_p95_s: float
    wall_s: float
    resume: dict[str, Any] | None = None
    failures: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _clean(text: str) -> str:
    """Drop U+FFFD: an untrained model emits stray bytes whose trailing partial UTF-8 sequence is
    rendered as U+FFFD or dropped depending on the detokenizer; neither is part of the answer."""
    return text.replace("\ufffd", "")


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: a reported latency was really observed)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class _RouterClient:
    """Greedy completions through the router, as any OpenAI client would send them."""

    def __init__(self, fleet: LocalFleet, max_tokens: int) -> None:
        headers = {"Authorization": f"Bearer {fleet.api_key}"} if fleet.api_key else {}
        self._http = httpx.Client(base_url=fleet.router_url, headers=headers, timeout=30.0)
        self.max_tokens = max_tokens

    def complete(self, model: str) -> tuple[str, int | None]:
        """(text, served version). Raises httpx.HTTPStatusError on a non-2xx answer."""
        r = self._http.post(
            "/v1/completions",
            json={
                "model": model,
                "prompt": PROMPT,
                "max_tokens": self.max_tokens,
                "temperature": 0,
            },
        )
        r.raise_for_status()
        body = r.json()
        tag = body.get("lorafleet") or {}
        return _clean(body["choices"][0]["text"]), tag.get("version")

    def probe(self, model: str) -> str:
        """What a client sees right now, as one line (used while the fleet is broken)."""
        try:
            text, version = self.complete(model)
        except httpx.HTTPStatusError as exc:
            try:
                message = exc.response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = exc.response.text[:120]
            return f"HTTP {exc.response.status_code}: {message}"
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}"
        return f"served v{version}: {text!r}"

    def close(self) -> None:
        self._http.close()


class _View:
    """The live progress table (a plain line per step when stdout is not a terminal)."""

    def __init__(self, console: Any, steps: int) -> None:
        from rich.live import Live

        self.console = console
        self.rows: list[StepRecord] = []
        self.steps = steps
        self.live = Live(self.table(), console=console, auto_refresh=False, transient=False)
        self.interactive = console.is_terminal

    def table(self) -> Any:
        from rich.markup import escape
        from rich.table import Table

        t = Table(title=f"training '{ADAPTER}' on CPU, publishing every step", title_justify="left")
        t.add_column("step", justify="right")
        t.add_column("version", justify="right")
        t.add_column("loss", justify="right")
        t.add_column("publish", justify="right")
        t.add_column("reward", justify="left")
        t.add_column("served (router, greedy)")
        t.add_column("= trainer", justify="center")
        for r in self.rows:
            bar = "█" * round(r.reward * 10)
            style = "green" if r.reward >= SUCCESS_REWARD else "yellow"
            step = f"{r.step}" + (" [bold magenta]restore[/]" if r.phase == "restore" else "")
            t.add_row(
                step,
                "-" if r.version is None else f"v{r.version}",
                "-" if r.loss is None else f"{r.loss:.3f}",
                "-" if r.publish_s is None else f"{r.publish_s * 1000:.0f} ms",
                f"[{style}]{r.reward:.2f} {bar}[/]",
                escape(repr(r.output)),
                "[green]✓[/]" if r.output == r.trainer_output else "[red]✗[/]",
            )
        return t

    def __enter__(self) -> _View:
        if self.interactive:
            self.live.start()
        return self

    def add(self, record: StepRecord) -> None:
        self.rows.append(record)
        if self.interactive:
            self.live.update(self.table(), refresh=True)
        else:
            self.console.print(
                f"step {record.step:>2} ({record.phase}) version="
                f"{'-' if record.version is None else record.version} "
                f"loss={'-' if record.loss is None else f'{record.loss:.3f}'} "
                f"publish={'-' if record.publish_s is None else f'{record.publish_s * 1000:.0f}ms'}"
                f" reward={record.reward:.2f} served={record.output!r}",
                highlight=False,
                markup=False,
            )

    def note(self, message: str) -> None:
        self.console.print(message)

    def __exit__(self, *exc: object) -> None:
        if self.interactive:
            self.live.stop()
        else:
            self.console.print(self.table())


def _quiet_hf() -> None:
    """No weight-loading progress bars or deprecation chatter between the demo's rows."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="peft")


def run_demo(
    *,
    steps: int = DEFAULT_STEPS,
    resume: bool = False,
    data_dir: str | Path | None = None,
    console: Any = None,
) -> DemoSummary:
    """Run the demo end to end and return its summary (``ok`` says whether the reward rose).

    Raises:
        RuntimeError, TimeoutError: the fleet could not start.
        lorafleet.errors.LorafleetError: a publish failed.
    """
    from rich.console import Console

    _quiet_hf()
    # Piped output (CI logs, tests) gets the full table rather than 80 wrapped columns.
    console = console or Console(width=None if sys.stdout.isatty() else 120)
    if steps < 2:
        raise ValueError("the demo needs at least 2 steps")
    t0 = time.monotonic()
    own_dir = data_dir is None
    root = Path(tempfile.mkdtemp(prefix="lorafleet-demo-")) if own_dir else Path(data_dir)
    ok = False
    try:
        summary = _run(console, steps=steps, resume=resume, root=root, t0=t0)
        ok = summary.ok
        return summary
    finally:
        if own_dir and ok:
            shutil.rmtree(root, ignore_errors=True)
        elif own_dir:
            console.print(f"[dim]fleet logs kept in {root / 'logs'}[/dim]")


def _run(console: Any, *, steps: int, resume: bool, root: Path, t0: float) -> DemoSummary:
    from lorafleet.fleet.skill import SkillTrainer
    from lorafleet.publisher import Publisher

    fleet = LocalFleet(
        FleetConfig.default(engines=2, data_dir=root),
        on_event=lambda m: console.print(f"[dim]{m}[/dim]"),
    )
    console.print("[bold]lorafleet demo[/bold]: 2 reference engines + 2 agents + a router, on CPU")
    from lorafleet.tinymodel import ensure_tiny_model

    base_dir = ensure_tiny_model()
    # The fleet's processes and the trainer's model load overlap; both take seconds.
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(fleet.start)
        try:
            trainer = SkillTrainer(base_dir, DEMO_SETTINGS)
            started.result()
        except BaseException:
            with contextlib.suppress(BaseException):
                started.result()  # let a half-started fleet finish before stopping it
            fleet.stop()
            raise
    failures: list[str] = []
    resume_info: dict[str, Any] | None = None
    records: list[StepRecord] = []
    router = _RouterClient(fleet, trainer.max_new_tokens)
    checkpoint = root / "checkpoints" / "native.pt"
    kill_after = steps // 2 if resume else None
    try:
        fleet.write_fleet_file()
        console.print(
            f"fleet up in {time.monotonic() - t0:.1f}s: router {fleet.router_url}, "
            f"agents {', '.join(fleet.agent_urls)}  "
            f"[dim](lorafleet status --data-dir {root})[/dim]"
        )
        console.print(f"prompt {PROMPT!r} → target {TARGET!r}")
        base_output, _ = router.complete(fleet.served_model_name)
        base_reward = reward(base_output)
        console.print(f"base model answers {base_output!r} (reward {base_reward:.2f})")

        publisher = Publisher(agents=fleet.agent_urls, router=fleet.router_url, token=fleet.token)
        with _View(console, steps) as view:
            for step in range(1, steps + 1):
                loss = trainer.train_step()
                t = time.perf_counter()
                result = publisher.publish(trainer.model, name=ADAPTER, mode="atomic")
                publish_s = time.perf_counter() - t
                records.append(_measure(router, trainer, step, "train", loss, result, publish_s))
                view.add(records[-1])
                served = records[-1].served_version
                if served != result.version:
                    failures.append(f"step {step}: published v{result.version}, served v{served}")
                if kill_after is None:
                    continue
                trainer.save_native(checkpoint)  # every step, like a real run; no PEFT export
                if step != kill_after:
                    continue
                publisher.close()
                resume_info = _crash_and_restore(fleet, router, view, checkpoint, base_dir, records)
                trainer = resume_info.pop("trainer")
                if not resume_info["restored"]:
                    failures.append("the first publish after the restart did not restore serving")
                publisher = Publisher(
                    agents=fleet.agent_urls, router=fleet.router_url, token=fleet.token
                )
        publisher.close()
    finally:
        router.close()
        fleet.stop()

    trained = [r for r in records if r.phase == "train"]
    latencies = [r.publish_s for r in records if r.publish_s is not None]
    final = trained[-1]
    rose = final.reward >= SUCCESS_REWARD and final.reward > base_reward
    if not rose:
        failures.append(f"reward did not rise: base {base_reward:.2f}, final {final.reward:.2f}")
    summary = DemoSummary(
        ok=not failures,
        steps=records,
        base_output=base_output,
        base_reward=base_reward,
        final_output=final.output,
        final_reward=final.reward,
        publish_p50_s=_percentile(latencies, 50),
        publish_p95_s=_percentile(latencies, 95),
        wall_s=time.monotonic() - t0,
        resume=resume_info,
        failures=failures,
    )
    _print_summary(console, summary)
    return summary


def _crash_and_restore(
    fleet: LocalFleet,
    router: _RouterClient,
    view: _View,
    checkpoint: Path,
    base_dir: Path,
    records: list[StepRecord],
) -> dict[str, Any]:
    """Lose every node, restart the trainer from its native checkpoint, publish once, compare."""
    from lorafleet.fleet.skill import SkillTrainer
    from lorafleet.publisher import Publisher

    before = records[-1]
    view.note(
        f"[bold red]💥 step {before.step}: killing both engines; new agents with empty stores; "
        "the trainer restarts from its native checkpoint[/]"
    )
    t = time.perf_counter()
    fleet.restart_engines(fresh_agents=True)
    restart_s = time.perf_counter() - t
    probe = router.probe(ADAPTER)
    view.note(f"   engines back from base in {restart_s:.1f}s; '{ADAPTER}' now: {probe}")

    files = sorted(p.name for p in checkpoint.parent.iterdir())
    trainer = SkillTrainer.resume(base_dir, checkpoint, DEMO_SETTINGS)
    view.note(
        f"   checkpoint {checkpoint.name} (files: {', '.join(files)}; no adapter_config.json) "
        f"restored at step {trainer.step}"
    )
    with Publisher(agents=fleet.agent_urls, router=fleet.router_url, token=fleet.token) as pub:
        t = time.perf_counter()
        # A native-only checkpoint: LoRA tensors + the config dict the trainer knows (seed 004).
        result = pub.publish(
            trainer.lora_state_dict(),
            name=ADAPTER,
            mode="atomic",
            config=trainer.config_dict(),
        )
        publish_s = time.perf_counter() - t
    record = _measure(router, trainer, trainer.step, "restore", None, result, publish_s)
    served = record.served_version
    records.append(record)
    view.add(record)
    restored = (
        record.output == before.output
        and record.reward == before.reward
        and served == result.version
    )
    mark = "[green]serving restored[/]" if restored else "[red]serving NOT restored[/]"
    view.note(
        f"   {mark}: first publish after restart (v{result.version}, state dict + config) "
        f"reward {record.reward:.2f} == {before.reward:.2f} before the kill"
    )
    return {
        "trainer": trainer,
        "killed_after_step": before.step,
        "reward_before_kill": before.reward,
        "output_before_kill": before.output,
        "probe_after_restart": probe,
        "restart_s": restart_s,
        "restore_version": result.version,
        "reward_after_restore": record.reward,
        "output_after_restore": record.output,
        "checkpoint_files": files,
        "restored": restored,
    }


def _print_summary(console: Any, s: DemoSummary) -> None:
    from rich.table import Table

    t = Table(title="summary", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    t.add_row("base model output", f"{s.base_output!r} (reward {s.base_reward:.2f})")
    t.add_row("final adapter output", f"{s.final_output!r} (reward {s.final_reward:.2f})")
    t.add_row("publishes", str(sum(1 for r in s.steps if r.publish_s is not None)))
    t.add_row(
        "publish latency p50 / p95",
        f"{s.publish_p50_s * 1000:.0f} ms / {s.publish_p95_s * 1000:.0f} ms",
    )
    if s.resume is not None:
        t.add_row(
            "resume",
            f"killed after step {s.resume['killed_after_step']}, restored by v"
            f"{s.resume['restore_version']}: "
            + ("[green]yes[/]" if s.resume["restored"] else "[red]no[/]"),
        )
    t.add_row("wall time", f"{s.wall_s:.1f}s")
    console.print(t)
    if s.ok:
        console.print("[bold green]OK[/]: the reward rose through the router")
    for f in s.failures:
        console.print(f"[bold red]FAIL[/]: {f}")


def write_summary(summary: DemoSummary | Any, path: str | Path) -> None:
    """Write a demo's summary (anything with ``to_json``) as JSON."""
    Path(path).write_text(json.dumps(summary.to_json(), indent=2) + "\n")
