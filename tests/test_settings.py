"""A service setting is declared once: its field is the option, the launch flag, the fleet key."""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from lorafleet._settings import argv_for
from lorafleet.agent.cli import command as agent_command
from lorafleet.agent.limits import UploadLimits
from lorafleet.fleet.config import FleetConfigError, load_fleet_config
from lorafleet.launch.specs import AgentSpec


def _help_defaults() -> str:
    return CliRunner().invoke(agent_command, ["--help"], terminal_width=200).output


def test_the_agent_options_show_the_settings_defaults():
    out = " ".join(_help_defaults().split())
    for f in dataclasses.fields(UploadLimits):
        flag = f.metadata["lorafleet.cli"].flag
        assert flag in out
    assert f"[default: {128 << 30}]" in out and f"[default: {64 << 20}; x>=0]" in out


def test_a_launch_spec_writes_only_what_differs_from_the_defaults(tmp_path):
    assert argv_for(UploadLimits()) == []
    limits = UploadLimits(max_file_bytes=1 << 20, direct_io_min_bytes=None, ttl_s=5.0)
    assert argv_for(limits) == [
        "--max-file-bytes", str(1 << 20), "--upload-ttl", "5.0", "--direct-io-min-bytes", "0",
    ]  # fmt: skip
    spec = AgentSpec(engine_url="http://127.0.0.1:9", data_dir=tmp_path, limits=limits)
    argv = spec.argv(3)
    assert argv[argv.index("--max-file-bytes") + 1] == str(1 << 20)
    assert argv[argv.index("--direct-io-min-bytes") + 1] == "0"


def test_the_fleet_file_takes_the_same_settings(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text("[[replica]]\n[replica.limits]\nmax_file_bytes = 4096\nttl_s = 30\n")
    cfg = load_fleet_config(path)
    assert cfg.replicas[0].limits == UploadLimits(max_file_bytes=4096, ttl_s=30.0)
    path.write_text("[[replica]]\n[replica.limits]\nmax_file_byte = 4096\n")
    with pytest.raises(FleetConfigError, match="max_file_byte"):
        load_fleet_config(path)
