"""The core never imports Ray: only ``lorafleet.ray`` does."""

from __future__ import annotations

import subprocess
import sys


def test_core_imports_do_not_pull_ray():
    code = (
        "import sys, lorafleet, lorafleet.cli, lorafleet.publisher, lorafleet.agent, "
        "lorafleet.router, lorafleet.fleet.cli, lorafleet.launch; "
        "assert 'ray' not in sys.modules, 'ray imported by the core'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
