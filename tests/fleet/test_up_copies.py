"""``lorafleet up`` with data-plane copies (``[router] copies``): clients reach the copies, the
Publisher the router, and ``lorafleet status`` shows every copy."""

from __future__ import annotations

import httpx

from lorafleet.fleet import LocalFleet
from lorafleet.fleet.config import FleetConfig, RouterSection, load_fleet_config
from lorafleet.fleet.status import collect_status, render_status
from lorafleet.fleetfile import read_fleet_file
from lorafleet.publisher import Publisher
from lorafleet.testing import make_peft_adapter, wait_until


def test_the_fleet_file_takes_a_number_of_copies(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text("[router]\ncopies = 3\ndata_port = 0\n")
    assert load_fleet_config(path).router.copies == 3
    assert FleetConfig.default().router.copies == 0  # the router serves by itself


def test_up_with_copies_serves_through_them(tmp_path, tiny_model):
    config = FleetConfig.default(
        engines=1, data_dir=tmp_path / "fleet", router=RouterSection(copies=2)
    )
    adapter = make_peft_adapter(tiny_model, tmp_path / "ad", seed=3)
    with LocalFleet(config) as fleet:
        fleet.write_fleet_file()
        info = read_fleet_file(fleet.data_dir)
        assert info.dataplane_url == fleet.dataplane_url != fleet.router_url
        assert info.inference_url == fleet.dataplane_url
        wait_until(lambda: len(collect_status(info).copies) == 2, timeout=60, message="2 copies")
        with Publisher(agents=fleet.agent_urls, router=fleet.router_url, token=fleet.token) as p:
            version = p.publish(adapter, name="policy").version
        r = httpx.post(
            info.inference_url + "/v1/completions",
            json={"model": "policy", "prompt": "hi", "max_tokens": 2},
            headers={"Authorization": f"Bearer {fleet.api_key}"},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["lorafleet"]["version"] == version
        status = collect_status(info)
        assert {c["acked"] for c in status.copies} == {status.table_seq}
        assert all(c["current"] and not c["fenced"] for c in status.copies)
        assert any(
            "data-plane copies" in str(getattr(t, "title", "")) for t in render_status(status, info)
        )
