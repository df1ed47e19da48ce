"""docs/reference/ is generated (``python -m lorafleet._reference --write``) and never stale."""

from __future__ import annotations

from pathlib import Path

from lorafleet._reference import render

ROOT = Path(__file__).resolve().parents[1]


def test_generated_references_are_current():
    stale = [
        rel
        for rel, text in render().items()
        if not (ROOT / rel).is_file() or (ROOT / rel).read_text() != text
    ]
    assert stale == [], f"stale: {stale}; run python -m lorafleet._reference --write"


def test_the_references_cover_every_command_and_code():
    from lorafleet.cli import main
    from lorafleet.protocol.errors import STATUS_BY_CODE

    refs = render()
    for name in main.commands:
        assert f"## lorafleet {name}\n" in refs["docs/reference/cli.md"], name
    for code, status in STATUS_BY_CODE.items():
        assert f"| `{code}` | {status} |" in refs["docs/reference/errors.md"], code
