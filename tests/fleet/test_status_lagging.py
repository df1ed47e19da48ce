"""``lorafleet status`` shows each lagging replica of a name: since when, why, next retry."""

from __future__ import annotations

import io
import time
from types import SimpleNamespace

from rich.console import Console

from lorafleet.fleet.status import FleetStatus, render_status


def test_status_renders_lagging_replicas():
    alias = {
        "name": "policy",
        "version": 3,
        "engine_name": "policy@v3",
        "replicas": ["r0", "r1"],
        "lagging": {
            "r2": {
                "since_version": 2,
                "reason": "did not answer within 5s",
                "failures": 2,
                "retry_at": time.time() + 60,
            }
        },
    }
    status = FleetStatus("http://r", True, None, False, [], [alias], 0)
    info = SimpleNamespace(data_dir="/d", served_model_name="tiny", model="m", dataplane_url=None)
    out = io.StringIO()
    console = Console(file=out, width=200)
    for part in render_status(status, info):  # type: ignore[arg-type]
        console.print(part)
    text = out.getvalue()
    assert "lagging replicas" in text
    line = next(x for x in text.splitlines() if "r2" in x and "v2" in x)
    assert "did not answer within 5s" in line and ("in 59s" in line or "in 60s" in line)
