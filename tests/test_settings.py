"""A service setting is declared once: its field is the option, the launch flag, the fleet key."""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from lorafleet._settings import argv_for
from lorafleet.agent.cli import command as agent_command
from lorafleet.agent.config import AgentSettings
from lorafleet.agent.limits import UploadLimits
from lorafleet.agent.spec import AgentSpec
from lorafleet.fleet.config import FleetConfigError, load_fleet_config


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
    path.write_text("[[replica]]\n[replica.agent]\nmax_adapters = 3\nshared_fs_allow = ['/x']\n")
    cfg = load_fleet_config(path)
    assert cfg.replicas[0].agent == AgentSettings(max_adapters=3, shared_fs_allow=["/x"])
    path.write_text("[[replica]]\n[replica.agent]\nmax_adapter = 3\n")
    with pytest.raises(FleetConfigError, match="max_adapter"):
        load_fleet_config(path)
    path.write_text("[[replica]]\n[replica.limits]\nmax_file_byte = 4096\n")
    with pytest.raises(FleetConfigError, match="max_file_byte"):
        load_fleet_config(path)


def _parsed(monkeypatch, module: str, argv: list[str], env: dict[str, str]):
    """The config object ``lorafleet <argv>`` would serve, parsed by the real command."""
    import importlib

    from click.testing import CliRunner

    from lorafleet.cli import main

    seen = []
    monkeypatch.setattr(f"lorafleet.{module}.app.create_app", lambda cfg: seen.append(cfg))
    monkeypatch.setattr("lorafleet.launch.listen.serve", lambda *a, **kw: None)
    importlib.import_module(f"lorafleet.{module}.app")
    result = CliRunner().invoke(main, argv, env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (cfg,) = seen
    return cfg


def test_each_launch_spec_field_reaches_its_setting_through_the_real_cli(tmp_path, monkeypatch):
    """A spec writes flags by hand only for what is not a setting; either way the real command
    parses what it writes into the field the spec means."""
    import socket

    from lorafleet.agent.spec import AgentSpec
    from lorafleet.router.spec import RouterSpec

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    host, port = sock.getsockname()
    try:
        spec = AgentSpec(
            engine="vllm",
            engine_url="http://127.0.0.1:1",
            data_dir=tmp_path / "data",
            token="t0ken",
            replica_id="r-7",
            settings=AgentSettings(
                max_lora_rank=32, shared_fs_allow=[str(tmp_path / "a"), str(tmp_path / "b")]
            ),
            limits=UploadLimits(max_file_bytes=1 << 20, ttl_s=5.0),
        )
        cfg = _parsed(monkeypatch, "agent", spec.argv(sock.fileno())[3:], spec.environ())
        assert (cfg.engine, cfg.engine_url, cfg.token, cfg.replica_id) == (
            "vllm", "http://127.0.0.1:1", "t0ken", "r-7"
        )  # fmt: skip
        assert cfg.data_dir == str(tmp_path / "data")
        assert cfg.max_lora_rank == 32
        assert cfg.shared_fs_allow == [str(tmp_path / "a"), str(tmp_path / "b")]
        assert cfg.limits == spec.limits

        plain = AgentSpec(engine_url="http://127.0.0.1:1", data_dir=tmp_path / "plain")
        cfg = _parsed(monkeypatch, "agent", plain.argv(sock.fileno())[3:], plain.environ())
        assert cfg.replica_id == f"{host}:{port}" and cfg.max_lora_rank is None
        assert cfg.shared_fs_allow == [] and cfg.limits == UploadLimits()

        router = RouterSpec(
            agents=("http://127.0.0.1:1", "http://127.0.0.1:2"),
            token="ctl",
            api_key="key",
            agent_token="agt",
            state_dir=tmp_path / "state",
            health_interval=0.25,
        )
        cfg = _parsed(monkeypatch, "router", router.argv(sock.fileno())[3:], router.environ())
        assert cfg.agents == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
        assert (cfg.control_token, cfg.api_key, cfg.agent_token) == ("ctl", "key", "agt")
        assert cfg.state_dir == str(tmp_path / "state") and cfg.health_interval_s == 0.25
    finally:
        sock.close()


def test_flags_names_only_settings_and_skips_defaults():
    from lorafleet._settings import flags
    from lorafleet.router.app import RouterConfig

    assert flags(RouterConfig, health_interval_s=0.5) == []  # the default: nothing to say
    assert flags(RouterConfig, health_interval_s=2.0) == ["--health-interval", "2.0"]
    with pytest.raises(TypeError, match="no setting agents"):
        flags(RouterConfig, agents=["x"])  # a plain field, not an option of its own
