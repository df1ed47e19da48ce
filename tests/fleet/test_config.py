"""The fleet file parser and fleet.json: pure, no processes."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from lorafleet.fleet.config import FleetConfig, FleetConfigError, load_fleet_config
from lorafleet.fleetfile import (
    FleetInfo,
    FleetNotFound,
    ReplicaInfo,
    read_fleet_file,
    remove_fleet_file,
    write_fleet_file,
)


def _toml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "fleet.toml"
    p.write_text(text)
    return p


def test_no_file_is_two_reference_engines() -> None:
    cfg = load_fleet_config(None)
    assert [r.engine for r in cfg.replicas] == ["reference", "reference"]
    assert all(r.managed_engine for r in cfg.replicas)
    assert cfg.host == "127.0.0.1"
    assert cfg.control_token is None and cfg.api_key is None  # generated at start


def test_engines_and_data_dir_override(tmp_path: Path) -> None:
    cfg = load_fleet_config(None, engines=3, data_dir=str(tmp_path))
    assert len(cfg.replicas) == 3
    assert cfg.data_dir == tmp_path


def test_full_file(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        """
[fleet]
data_dir = "state"
served_model_name = "base"
api_key = ""

[router]
port = 8123

[[replica]]
engine = "reference"
max_lora_rank = 16

[[replica]]
engine = "vllm"
url = "http://127.0.0.1:8001"
agent_port = 9001
""",
    )
    cfg = load_fleet_config(path)
    assert cfg.data_dir == Path("state")
    assert cfg.served_model_name == "base"
    assert cfg.api_key == ""
    assert cfg.router.port == 8123
    ref, vllm = cfg.replicas
    assert ref.managed_engine and ref.max_lora_rank == 16
    assert not vllm.managed_engine and vllm.url == "http://127.0.0.1:8001"
    assert vllm.agent_port == 9001


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[fleet]\ndatadir = 'x'\n", "datadir"),
        ("[routr]\nport = 1\n", "routr"),
        ("[[replica]]\nengine = 'vllm'\n", "needs url"),
        ("[[replica]]\nengine = 'tgi'\nurl = 'http://x'\n", "engine must be one of"),
        ("[[replica]]\nengine = 'sglang'\nurl = 'localhost:30000'\n", "http(s) URL"),
        ("[[replica]]\nengin = 'vllm'\n", "engin"),
        ("[fleet\n", "fleet.toml"),
    ],
)
def test_bad_files_fail_early(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(FleetConfigError, match=None) as err:
        load_fleet_config(_toml(tmp_path, text))
    assert needle in str(err.value)


def test_engines_conflicts_with_declared_replicas(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[[replica]]\nengine = 'reference'\n")
    with pytest.raises(FleetConfigError, match="--engines"):
        load_fleet_config(path, engines=2)


def test_default_needs_an_engine() -> None:
    with pytest.raises(FleetConfigError):
        FleetConfig.default(engines=0)


def test_fleet_file_roundtrip_is_private(tmp_path: Path) -> None:
    info = FleetInfo(
        data_dir=str(tmp_path),
        router_url="http://127.0.0.1:1",
        control_token="secret",
        api_key=None,
        model="/m",
        served_model_name="tiny",
        replicas=[ReplicaInfo("reference", "http://127.0.0.1:2", "http://127.0.0.1:3", 10, 11)],
        pid=123,
    )
    path = write_fleet_file(info, tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_fleet_file(tmp_path) == info
    remove_fleet_file(tmp_path, owner_pid=999)  # not ours: kept
    assert path.exists()
    remove_fleet_file(tmp_path, owner_pid=123)
    with pytest.raises(FleetNotFound):
        read_fleet_file(tmp_path)
