"""schemathesis against the skyrl dialect of the front (its own routes and the vLLM dialect's),
served on loopback over the fuzz targets' real router and agent, with tokenless control from
loopback as SkyRL runs it. Every new schema (protocol/skyrl.py's bodies, the upload headers,
the token-in generation body) is fuzzed with positive and negative data; no input may get a 5xx
or an answer outside the document.
"""

from __future__ import annotations

from lorafleet.front.service import FrontConfig
from lorafleet.front.uploads import UploadDirLimits
from tests.front.skyrl_helpers import serving
from tests.fuzz.conftest import API_KEY, TOKEN
from tests.fuzz.helpers import from_url, fuzz


def test_skyrl_front_answers_inside_its_document(targets, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    cfg = FrontConfig(
        agents=[targets.agent.url],
        router=targets.router.url,
        shared_dirs=[shared],
        fleet_token=TOKEN,
        api_key=API_KEY,
        allow_unauthenticated_control=True,
        dialect="skyrl",
        upload_dir=tmp_path / "uploads",
        upload_limits=UploadDirLimits(max_file_bytes=1 << 20, quota_bytes=4 << 20, ttl_s=60),
    )
    with serving(cfg) as url:
        schema = from_url(url + "/openapi.json")
        found = fuzz(schema, max_examples=6)
    assert not found, "\n\n".join(found)
    # Whatever the fuzzer sent, no upload bytes stayed behind.
    assert not [p for p in (tmp_path / "uploads").rglob("*") if p.is_file()]
