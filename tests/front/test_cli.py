"""``lorafleet front``'s refusals at startup: an open control plane needs the operator's word."""

from __future__ import annotations

from click.testing import CliRunner

from lorafleet.cli import main

ARGS = ["front", "--agents", "http://127.0.0.1:9", "--router", "http://127.0.0.1:9"]


def test_refuses_to_start_without_a_token_or_the_explicit_flag(tmp_path, monkeypatch):
    for var in ("LORAFLEET_CONTROL_TOKEN", "LORAFLEET_FRONT_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    out = CliRunner().invoke(main, [*ARGS, "--shared-dir", str(tmp_path)])
    assert out.exit_code == 2 and "--allow-unauthenticated-control" in out.output


def test_refuses_a_name_pattern_without_its_groups(tmp_path):
    args = [*ARGS, "--shared-dir", str(tmp_path), "--trainer-token", "t", "--name-pattern", "x"]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 2 and "(?P<version>)" in out.output


def test_refuses_a_bad_allow_list(tmp_path):
    args = [*ARGS, "--shared-dir", str(tmp_path), "--allow-unauthenticated-control"]
    out = CliRunner().invoke(main, [*args, "--control-allow-from", "not-an-address"])
    assert out.exit_code == 2


def test_help_names_every_dialect_of_the_registry():
    from lorafleet.front.dialects import DIALECTS

    out = CliRunner().invoke(main, ["front", "--help"], terminal_width=100)
    assert out.exit_code == 0, out.output
    listed = out.output.split("Dialects (--dialect):", 1)[1].split("Options:", 1)[0]
    assert [line.split()[0] for line in listed.strip().splitlines()] == list(DIALECTS)
    for d in DIALECTS.values():
        assert d.summary in listed, d.name
    assert "SkyRL" in listed
