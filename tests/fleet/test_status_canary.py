"""``lorafleet status`` shows each replica's canary verdict (only when a version has one)."""

from __future__ import annotations

import io
from types import SimpleNamespace

from rich.console import Console

from lorafleet.fleet.status import FleetStatus, ReplicaView, render_status


def _text(adapters: list[dict]) -> str:
    replica = ReplicaView(0, "reference", "http://a", "http://e", "r0", True, adapters=adapters)
    return _render(FleetStatus("http://r", True, None, False, [replica], [], 0))


def _render(status: FleetStatus) -> str:
    info = SimpleNamespace(data_dir="/d", served_model_name="tiny", model="m", dataplane_url=None)
    out = io.StringIO()
    console = Console(file=out, width=220)
    for part in render_status(status, info):  # type: ignore[arg-type]
        console.print(part)
    return out.getvalue()


RECORD = {"name": "policy", "version": 1, "engine_name": "policy@v1", "state": "active",
          "application": "applied", "digest": "sha256:" + "0" * 64}  # fmt: skip


def test_a_canary_verdict_is_shown_with_its_figures():
    verdict = {"outcome": "passed", "mean_vs_trainer": 3.6e-7, "mean_vs_base": 1.32}
    text = _text([{**RECORD, "canary": verdict}])
    assert "canary" in text
    row = next(x for x in text.splitlines() if "policy@v1" in x)
    assert "passed (3.6e-07 vs trainer, 1.3 vs base)" in row


def test_no_canary_column_without_a_canary():
    text = _text([RECORD])
    assert "canary" not in text and "applied" in text


def _with_aliases(aliases: list[dict]) -> str:
    return _render(FleetStatus("http://r", True, None, False, [], aliases, 0))


ALIAS = {"name": "policy", "version": 2, "engine_name": "policy@v2", "replicas": ["r0"]}


def test_a_cold_version_and_placement_sets_are_shown():
    text = _with_aliases(
        [
            ALIAS,
            {**ALIAS, "name": "tail", "engine_name": "tail@v2", "replicas": [], "placement": []},
        ]
    )
    assert "placement" in text
    assert "cold (loaded on demand)" in next(x for x in text.splitlines() if "tail@v2" in x)
    assert "every replica" in next(x for x in text.splitlines() if "policy@v2" in x)


def test_no_placement_column_when_every_name_is_everywhere():
    assert "placement" not in _with_aliases([ALIAS])


def test_catch_up_trees_are_shown_with_their_progress():
    status = FleetStatus("http://r", True, None, False, [], [], 0)
    status.catch_up = [
        {"name": "policy", "version": 3, "source": "r0", "fed": 2, "replicas": 5},
    ]
    text = _render(status)
    assert "catching up" in text
    row = next(x for x in text.splitlines() if "policy" in x and "v3" in x)
    assert "r0" in row and "2 of 5" in row
    assert "catching up" not in _with_aliases([])
