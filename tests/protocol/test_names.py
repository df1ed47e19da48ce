"""The one name rule (lorafleet.protocol.names) and every entry point that applies it."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from lorafleet.errors import InvalidName, InvalidRequest, ManifestInvalid
from lorafleet.protocol.manifest import Manifest
from lorafleet.protocol.names import (
    MAX_VERSION,
    check_engine_name,
    check_holder,
    check_name,
    is_valid_name,
)

HOSTILE = [
    "policy\n",  # passed the old rule: a regex ending in $ used with .match
    "policy\r\n",
    "..",
    ".hidden",
    "-flag",
    "a/b",
    "a\\b",
    "a\x00b",
    "\x00",
    "a" * 129,
    "a" * 4096,
    "pol\u202eicy",  # right-to-left override
    "pólicy",
    "policy@v1",  # an engine-side name is not an adapter name
    "base:policy",  # SGLang's addressing
    "",
    " policy",
    "policy ",
]


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_names_are_refused_with_their_code(name):
    assert not is_valid_name(name)
    with pytest.raises(InvalidName) as ei:
        check_name(name)
    assert ei.value.code == "invalid_name" and ei.value.status == 400
    assert isinstance(ei.value, InvalidRequest) and isinstance(ei.value, ValueError)
    assert "\n" not in ei.value.message and "\x00" not in ei.value.message  # shown repr'd
    assert len(ei.value.message) < 300


@pytest.mark.parametrize("name", ["p", "policy", "Policy-2.v3_x", "0", "a" * 128])
def test_good_names_pass(name):
    assert check_name(name) == name


@pytest.mark.parametrize("value", [None, 7, b"policy", ["policy"]])
def test_non_strings_are_refused(value):
    with pytest.raises(InvalidName):
        check_name(value)


def test_engine_names_and_holders():
    assert check_engine_name("policy") == "policy"
    assert check_engine_name("policy@v12") == "policy@v12"
    for bad in ["", "policy@", "policy@v", "policy@v0", "policy@v1\n", "@v1", "a@v1@v2"]:
        with pytest.raises(InvalidName):
            check_engine_name(bad)
    assert check_holder("host-1.lan:1234:0a1b2c3d") == "host-1.lan:1234:0a1b2c3d"
    for bad in ["", " ", "a b", "a\n", "x" * 257, ":lead"]:
        with pytest.raises(InvalidName):
            check_holder(bad)


def test_manifest_takes_the_rule_and_the_version_cap():
    files = [{"path": "adapter_config.json", "size": 2, "sha256": "0" * 64}]
    ok = Manifest(name="p", version=MAX_VERSION, config={}, files=files)
    assert ok.version == MAX_VERSION
    for bad in ({"name": "p\n", "version": 1}, {"name": "p", "version": MAX_VERSION + 1}):
        with pytest.raises(ValueError):
            Manifest(**bad, config={}, files=files)
    with pytest.raises(ValueError):  # the digest, too, must match in full
        Manifest(name="p", version=1, config={}, files=[{**files[0], "sha256": "0" * 64 + "\n"}])


def test_bundle_refuses_a_hostile_name(tmp_path):
    from lorafleet.bundle import AdapterBundle

    cfg = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "peft_type": "LORA"}
    with pytest.raises(ManifestInvalid, match="invalid adapter name"):
        AdapterBundle.from_any({}, name="policy\n", config=cfg)


def test_publisher_refuses_before_any_byte():
    """No agent listens at these URLs: the name is refused before anything is contacted."""
    from lorafleet.publisher import Publisher

    with (
        Publisher(agents=["http://127.0.0.1:9"], token="t") as publisher,
        pytest.raises(InvalidName),
    ):
        publisher.publish({}, name="policy\n", config={"r": 8})


def test_cli_publish_refuses_a_hostile_name_and_version(tmp_path):
    from lorafleet.cli import main

    runner = CliRunner()
    r = runner.invoke(main, ["publish", str(tmp_path), "--name", "policy\n", "--agents", "x"])
    assert r.exit_code == 2 and "invalid adapter name" in r.output
    r = runner.invoke(
        main,
        ["publish", str(tmp_path), "--name", "p", "--version", str(2**63), "--agents", "x"],
    )
    assert r.exit_code == 2 and "--version" in r.output
