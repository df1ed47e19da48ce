"""The fleet record outside Ray: moves are remembered across a restart of its actor, a new
deployment's record is not mistaken for an old one, and shutting down removes the file."""

from __future__ import annotations

import importlib.util
import json
import stat

import pytest

# Not imported here: Ray reads its environment when first imported (see conftest.py).
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="the ray extra is not installed"
)


def _record(started_at: float = 1.0) -> dict:
    return {
        "namespace": "ns",
        "router_url": "http://10.0.0.1:9000",
        "token": "secret",
        "started_at": started_at,
        "replicas": [
            {"agent_url": "http://10.0.0.2:1", "engine_url": "http://10.0.0.2:2", "node_id": "a"},
            {"agent_url": "http://10.0.0.3:1", "engine_url": "http://10.0.0.3:2", "node_id": "b"},
        ],
    }


def test_place_replica_reports_a_move_once_and_survives_a_restart(tmp_path):
    from lorafleet.ray._record import FleetRecord

    path = tmp_path / "record.json"
    rec = FleetRecord(_record(), str(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds the token
    same = rec.place_replica(
        1, agent_url="http://10.0.0.3:1", engine_url="http://10.0.0.3:2", node_id="b"
    )
    assert same is None  # a restart in place
    was = rec.place_replica(
        1, agent_url="http://10.0.0.9:5", engine_url="http://10.0.0.9:6", node_id="c"
    )
    assert was == "http://10.0.0.3:1"
    rec.set_router_url("http://10.0.0.1:9001")

    # Ray re-runs the constructor with the deployment's record: the file's moves win.
    again = FleetRecord(_record(), str(path)).get()
    assert again["replicas"][1] == {
        "agent_url": "http://10.0.0.9:5",
        "engine_url": "http://10.0.0.9:6",
        "node_id": "c",
    }
    assert again["replicas"][0]["agent_url"] == "http://10.0.0.2:1"
    assert again["router_url"] == "http://10.0.0.1:9001"


def test_a_new_deployment_ignores_an_old_file_and_forget_removes_it(tmp_path):
    from lorafleet.ray._record import FleetRecord

    path = tmp_path / "record.json"
    old = FleetRecord(_record(started_at=1.0), str(path))
    old.place_replica(0, agent_url="http://10.0.0.7:1", engine_url="http://10.0.0.7:2", node_id="x")
    new = FleetRecord(_record(started_at=2.0), str(path))
    assert new.get()["replicas"][0]["agent_url"] == "http://10.0.0.2:1"
    assert json.loads(path.read_text())["started_at"] == 2.0
    new.forget()
    assert not path.exists()
    new.set_router_url("http://10.0.0.1:1")  # memory only from now on
    assert not path.exists()


def test_a_torn_or_foreign_file_is_not_trusted(tmp_path):
    from lorafleet.ray._record import FleetRecord

    path = tmp_path / "record.json"
    path.write_text("{not json")
    assert FleetRecord(_record(), str(path)).get() == _record()
    path.write_text("[1, 2]")
    assert FleetRecord(_record(), str(path)).get() == _record()
