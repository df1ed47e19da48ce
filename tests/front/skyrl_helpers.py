"""What the SkyRL tests share: SkyRL's 3.12 client venv, the front under uvicorn, the driver run."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from lorafleet.front.app import create_app
from lorafleet.front.service import FrontConfig
from lorafleet.testing import wait_until

DRIVER = Path(__file__).with_name("skyrl_driver.py")
SKYRL_VERSION = "0.4.0"

# SkyRL 0.4.0's client module names torch types in annotations only (``torch.Tensor | None``,
# ``torch.int32`` as a default), evaluated at import. There is no torch for Python 3.12 here (the
# local wheel is 3.11's; any other pulls a multi-GB CUDA build), so the tests put this minimal
# import-time stand-in first on the client's PYTHONPATH: every attribute is a fresh empty class,
# enough for annotations, and nothing the client runs touches it.
TORCH_STAND_IN = '''"""An import-time stand-in for torch (lorafleet's SkyRL tests)."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (), {})
'''


def skyrl_venv() -> Path:
    """SkyRL's client venv (scripts/setup-skyrl.sh), or skip the test."""
    if os.environ.get("LORAFLEET_SKIP_SKYRL") == "1":
        pytest.skip("SkyRL tier off: LORAFLEET_SKIP_SKYRL=1")
    if venv := os.environ.get("LORAFLEET_SKYRL_VENV"):
        path = Path(venv)
    else:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        path = cache / "lorafleet" / f"venv-skyrl-{SKYRL_VERSION}"
    if not (path / ".lorafleet-ready").is_file():
        pytest.skip(
            f"SkyRL tier off: no finished SkyRL venv at {path} (scripts/setup-skyrl.sh installs "
            "it; scripts/test.sh runs it)"
        )
    return path


def run_driver(
    venv: Path, stand_in_dir: Path, plan: dict, work: Path, driver: Path = DRIVER
) -> dict:
    """Run SkyRL's own client code through ``driver`` (default tests/front/skyrl_driver.py) on
    ``plan``; its JSON record."""
    torch_dir = stand_in_dir / "torch"
    torch_dir.mkdir(parents=True, exist_ok=True)
    (torch_dir / "__init__.py").write_text(TORCH_STAND_IN)
    plan_file, out_file = work / "plan.json", work / "out.json"
    plan_file.write_text(json.dumps(plan))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(stand_in_dir)
    proc = subprocess.run(
        [str(venv / "bin" / "python"), str(driver), str(plan_file), str(out_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"SkyRL's client failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out_file.read_text())


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # not the main thread
        pass


@contextlib.contextmanager
def serving(cfg: FrontConfig) -> Iterator[str]:
    """The front app for ``cfg`` under uvicorn in a thread; yields its base URL."""
    server = _Server(uvicorn.Config(create_app(cfg), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started and server.servers, message="the front started")
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
