"""SkyRL, unmodified, on a lorafleet fleet: ``lorafleet front --dialect skyrl`` over 2 reference
replicas, driven by SkyRL 0.4.0's own ``RemoteInferenceClient`` (a subprocess in SkyRL's 3.12
venv; see tests/front/skyrl_helpers.py for the torch stand-in it imports with), and SkyRL's
remote-upload protocol checked call by call from its specification (the pull request's client,
which would send it, is not in any SkyRL release: 0.4.0 has no remote upload).
"""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from lorafleet.front.service import FrontConfig
from lorafleet.front.uploads import UploadDirLimits
from lorafleet.launch import Launcher
from lorafleet.testing import make_peft_adapter, merged_greedy_ids, wait_until
from tests.fleets import Fleet
from tests.front.skyrl_helpers import run_driver, serving, skyrl_venv

pytestmark = pytest.mark.timeout(900)

PROMPT = "The quick brown fox"
MAX_TOKENS = 8
ROUTER_KEY = "sk-skyrl-router"
CAP = 256 << 10  # per-file cap of remote uploads here: the tiny adapter is ~60 KiB
QUOTA = 200 << 10
TTL = 1.5


@dataclass
class SkyRLFront:
    url: str
    fleet: Fleet
    shared: Path
    uploads: Path
    cfg: FrontConfig


@pytest.fixture(scope="module")
def skyrl_front(tiny_model, make_fleet, tmp_path_factory) -> Iterator[SkyRLFront]:
    """One fleet and one skyrl-dialect front for the module (tests use their own names)."""
    root = tmp_path_factory.mktemp("skyrl")
    shared, uploads = root / "shared", root / "uploads"
    shared.mkdir()
    with Launcher(root / "logs") as launcher:
        fleet = make_fleet(launcher, 2, shared=shared, router=False)
        fleet.router = fleet.start_router(api_key=ROUTER_KEY, state_dir=root / "router")
        cfg = FrontConfig(
            agents=fleet.agent_urls,
            router=fleet.router.url,
            shared_dirs=[shared],
            fleet_token=fleet.token,
            api_key=ROUTER_KEY,
            allow_unauthenticated_control=True,  # SkyRL's client sends no token
            dialect="skyrl",
            upload_dir=uploads,
            upload_limits=UploadDirLimits(max_file_bytes=CAP, quota_bytes=QUOTA, ttl_s=TTL),
            drain_timeout_s=10.0,
        )
        with serving(cfg) as url:
            yield SkyRLFront(url, fleet, shared, uploads, cfg)


def _tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


def test_skyrl_client_sync_rounds(skyrl_front, tiny_model, tmp_path):
    """Four syncs into one directory (the third unpublishable), sessions across them, unload."""
    venv = skyrl_venv()
    staged = tmp_path / "trainer"
    adapters = [make_peft_adapter(tiny_model, staged / f"step{s}", seed=s) for s in (1, 2, 3)]
    bad = staged / "bad"
    bad.mkdir()
    for f in adapters[0].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "adapter_model.safetensors").write_bytes(b"\0" * 64)  # no safetensors header
    want = [merged_greedy_ids(tiny_model, a, PROMPT, MAX_TOKENS) for a in adapters]
    plan = {
        "url": skyrl_front.url,
        "model_name": "tiny",
        "sync_dir": str(skyrl_front.shared / "skyrl_lora_sync"),
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "rounds": [
            {"adapter": str(adapters[0])},
            {"adapter": str(adapters[1])},
            {"adapter": str(bad), "bad": True},
            {"adapter": str(adapters[2])},
        ],
    }
    out = run_driver(venv, tmp_path / "stand-in", plan, tmp_path)
    tok = _tokenizer(tiny_model)
    assert out["world_size"] == [1, 1]
    assert out["prompt_ids"] == tok(PROMPT).input_ids  # /tokenize, answered by an engine

    # (round, expected ids, lorafleet version serving it)
    serving_round = [(0, 1), (1, 2), (1, 2), (2, 3)]
    for k, rec in enumerate(out["rounds"]):
        i, version = serving_round[k]
        if rec["bad"]:
            # SkyRL's load raises (fail closed); nothing changed, the previous version serves.
            assert not rec["load"]["ok"] and 400 <= rec["load"]["status"] < 500, rec["load"]
        else:
            assert rec["load"]["ok"], rec["load"]
            body = rec["load"]["body"]
            assert body["status"] == "ok" and body["lora_name"] == "skyrl-lora"
            assert body["lora_int_id"] == version and body["lorafleet"]["replicas"] == 2
        assert rec["generate"]["ids"] == [want[i], want[i]], (k, rec["generate"])
        assert rec["generate"]["text"] == [tok.decode(want[i])] * 2  # /detokenize
        assert [len(lp) for lp in rec["generate"]["logprobs"]] == [MAX_TOKENS] * 2
        assert all(isinstance(x, float) and x <= 0 for x in rec["generate"]["logprobs"][0])
        assert rec["session"] == {"ids": want[i], "version": version}
        for answer in rec["reset"].values():
            engines = answer["body"]["lorafleet"]["engines"]
            assert answer["body"]["success"] is True
            assert [e["result"] for e in engines] == ["no_prefix_cache"] * 2
        for answer in rec["pause"].values():
            assert answer["status"] == 200
        if k:
            # The episode that started a round ago keeps its version until it is finished...
            prev_i, prev_version = serving_round[k - 1]
            assert rec["old_session"] == {"ids": want[prev_i], "version": prev_version}
            # ...and a finished session starts again on the newest.
            assert rec["old_session_after_finish"] == {"ids": want[i], "version": version}

    # Unload retires the name: refused as vLLM refuses an unloaded adapter, versions released.
    assert out["after_unload"]["status"] == 404, out["after_unload"]
    assert "skyrl-lora" in out["after_unload"]["error"]
    for i in range(2):
        assert not [a for a in skyrl_front.fleet.adapters(i) if a["name"] == "skyrl-lora"]
    table = httpx.get(
        skyrl_front.fleet.router.url + "/v1/control/aliases",
        headers={"Authorization": f"Bearer {skyrl_front.fleet.token}"},
    ).json()
    assert "skyrl-lora" not in table["aliases"]
    # CUDA-IPC staging cannot reach a fleet: a 400 that names the alternatives.
    assert out["in_memory"]["status"] == 400
    assert "lora_sync_path" in out["in_memory"]["error"]
    assert "upload_id" in out["in_memory"]["error"]


# --- the remote-upload protocol, from its specification -----------------------------------------


def _chunks(data: bytes, size: int = 1 << 14) -> Iterator[bytes]:
    """A generator body: httpx sends it chunked, without Content-Length, as SkyRL's client does."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


def _put(url: str, uid: str, name: str, data: bytes, **headers: str) -> httpx.Response:
    h = {
        "X-SkyRL-SHA256": hashlib.sha256(data).hexdigest(),
        "X-SkyRL-File-Size": str(len(data)),
        **headers,
    }
    h = {k: v for k, v in h.items() if v != ""}
    return httpx.put(
        f"{url}/skyrl/v1/lora-adapters/{uid}/{name}", content=_chunks(data), headers=h, timeout=60
    )


def _staged(front: SkyRLFront) -> list[Path]:
    while True:
        try:
            return [p for p in (front.uploads / "skyrl-uploads").rglob("*") if p.is_file()]
        except FileNotFoundError:  # the front's reaper removed a folder under the walk: again
            continue


def _upload(front: SkyRLFront, adapter: Path, uid: str) -> None:
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        data = (adapter / name).read_bytes()
        r = _put(front.url, uid, name, data)
        assert r.status_code == 200, r.text
        assert r.json() == {"filename": name, "sha256": hashlib.sha256(data).hexdigest()}


def _load(front: SkyRLFront, body: dict) -> httpx.Response:
    return httpx.post(f"{front.url}/skyrl/v1/load_lora_adapter", json=body, timeout=300)


def _generate(front: SkyRLFront, ids: list[int], model: str) -> httpx.Response:
    sp = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
    body = {"model": model, "token_ids": ids, "sampling_params": sp}
    return httpx.post(f"{front.url}/inference/v1/generate", json=body, timeout=120)


def test_remote_upload_conformance(skyrl_front, tiny_model, tmp_path):
    front = skyrl_front
    tok = _tokenizer(tiny_model)
    ids = tok(PROMPT).input_ids
    good = make_peft_adapter(tiny_model, tmp_path / "good", seed=11)
    want = merged_greedy_ids(tiny_model, good, PROMPT, MAX_TOKENS)

    # A full upload, loaded by upload_id: published to every replica, staging gone.
    uid = str(uuid.uuid4())
    _upload(front, good, uid)
    r = _load(front, {"lora_name": "skyrl-up", "upload_id": uid})
    assert r.status_code == 200, r.text
    assert (r.json()["status"], r.json()["lora_name"], r.json()["lora_int_id"]) == (
        "ok",
        "skyrl-up",
        1,
    )
    assert _staged(front) == []
    assert httpx.delete(f"{front.url}/skyrl/v1/lora-adapters/{uid}").json() == {"status": "ok"}
    r = _generate(front, ids, "skyrl-up")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    assert r.json()["lorafleet"]["version"] == 1
    assert r.json()["model"] == "skyrl-up"

    config = (good / "adapter_config.json").read_bytes()
    weights = (good / "adapter_model.safetensors").read_bytes()
    sha = hashlib.sha256(weights).hexdigest()
    refusals = [
        # (what, upload id, file name, body, headers, status)
        ("no digest", None, "adapter_config.json", config, {"X-SkyRL-SHA256": ""}, 400),
        ("no size", None, "adapter_config.json", config, {"X-SkyRL-File-Size": ""}, 400),
        ("bad digest", None, "adapter_config.json", config, {"X-SkyRL-SHA256": "zz" * 32}, 400),
        ("bad size", None, "adapter_config.json", config, {"X-SkyRL-File-Size": "1e3"}, 400),
        ("not a uuid", "12345678-zzzz", "adapter_config.json", config, {}, 400),
        ("unknown file", None, "model.py", config, {}, 400),
        ("more than declared", None, "adapter_model.safetensors", weights,
         {"X-SkyRL-File-Size": str(len(weights) - 1)}, 400),
        ("size mismatch", None, "adapter_model.safetensors", weights,
         {"X-SkyRL-File-Size": str(len(weights) + 1)}, 400),
        ("flipped byte", None, "adapter_model.safetensors",
         weights[:100] + bytes([weights[100] ^ 1]) + weights[101:], {"X-SkyRL-SHA256": sha}, 400),
        ("over the cap", None, "adapter_model.safetensors", b"",
         {"X-SkyRL-File-Size": str(CAP + 1)}, 413),
        ("negative size", None, "adapter_model.safetensors", b"", {"X-SkyRL-File-Size": "-1"}, 413),
        ("over the quota", None, "adapter_model.safetensors", b"",
         {"X-SkyRL-File-Size": str(QUOTA + 1 - len(config))}, 413),
    ]  # fmt: skip
    for what, bad_id, name, data, headers, status in refusals:
        uid = bad_id or str(uuid.uuid4())
        if bad_id is None:  # a verified file of the same upload goes too: nothing stays
            assert _put(front.url, uid, "adapter_config.json", config).status_code == 200
        r = _put(front.url, uid, name, data, **headers)
        assert r.status_code == status, (what, r.status_code, r.text)
        assert r.json()["error"]["message"], what
        assert _staged(front) == [], what
        if bad_id is None:
            # The load of a refused upload: incomplete, nothing published, v1 still serves.
            r = _load(front, {"lora_name": "skyrl-up", "upload_id": uid})
            assert r.status_code == 400 and "LoRA upload is incomplete." in r.text, what
    r = _generate(front, ids, "skyrl-up")
    assert (r.json()["choices"][0]["token_ids"], r.json()["lorafleet"]["version"]) == (want, 1)

    # Load bodies the protocol refuses.
    r = _load(front, {"lora_name": "skyrl-up", "upload_id": str(uuid.uuid4()), "lora_path": "/x"})
    assert r.status_code == 400 and "Provide either lora_path or upload_id." in r.text
    r = _load(front, {"lora_name": "skyrl-up"})
    assert r.status_code == 400 and "Provide either lora_path or upload_id." in r.text
    r = _load(front, {"lora_name": "skyrl-up", "upload_id": "not-a-uuid"})
    assert r.status_code == 400 and "Invalid LoRA upload id." in r.text

    # DELETE reaps a staged upload; an abandoned one is reaped after the TTL.
    uid = str(uuid.uuid4())
    assert _put(front.url, uid, "adapter_config.json", config).status_code == 200
    assert _staged(front)
    assert httpx.delete(f"{front.url}/skyrl/v1/lora-adapters/{uid}").status_code == 200
    assert _staged(front) == []
    assert httpx.delete(f"{front.url}/skyrl/v1/lora-adapters/nope").status_code == 400
    uid = str(uuid.uuid4())
    assert _put(front.url, uid, "adapter_config.json", config).status_code == 200
    wait_until(lambda: not _staged(front), timeout=TTL + 10, message="the abandoned upload reaped")
    r = _load(front, {"lora_name": "skyrl-up", "upload_id": uid})
    assert r.status_code == 400 and "LoRA upload is incomplete." in r.text

    # A second full upload, its two files sent at once, is the next version; a second PUT of
    # a file being received is refused alone; a path outside --shared-dir is refused.
    uid = str(uuid.uuid4())
    again = make_peft_adapter(tiny_model, tmp_path / "again", seed=12)
    names = ("adapter_config.json", "adapter_model.safetensors")
    with ThreadPoolExecutor(2) as pool:
        sent = list(pool.map(lambda n: _put(front.url, uid, n, (again / n).read_bytes()), names))
    assert [r.status_code for r in sent] == [200, 200], [r.text for r in sent]
    # A second PUT of a file still being received is refused alone; the first one completes.
    uid2, gate = str(uuid.uuid4()), threading.Event()

    def held() -> Iterator[bytes]:
        yield weights[:100]
        gate.wait(30)
        yield weights[100:]

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(
            httpx.put,
            f"{front.url}/skyrl/v1/lora-adapters/{uid2}/adapter_model.safetensors",
            content=held(),
            headers={"X-SkyRL-SHA256": sha, "X-SkyRL-File-Size": str(len(weights))},
            timeout=60,
        )
        wait_until(
            lambda: any(uid2 in str(p) for p in _staged(front)), message="the first PUT started"
        )
        r = _put(front.url, uid2, "adapter_model.safetensors", weights)
        assert r.status_code == 400 and "being received already" in r.text, r.text
        gate.set()
        assert first.result().status_code == 200, first.result().text
    assert httpx.delete(f"{front.url}/skyrl/v1/lora-adapters/{uid2}").status_code == 200
    r = _load(front, {"lora_name": "skyrl-up", "upload_id": uid})
    assert r.status_code == 200 and r.json()["lora_int_id"] == 2, r.text
    r = _generate(front, ids, "skyrl-up")
    assert r.json()["choices"][0]["token_ids"] == merged_greedy_ids(
        tiny_model, again, PROMPT, MAX_TOKENS
    )
    r = _load(front, {"lora_name": "skyrl-up", "lora_path": str(tmp_path / "good")})
    assert r.status_code == 403
    r = httpx.post(f"{front.url}/v1/unload_lora_adapter", json={"lora_name": "skyrl-up"})
    assert r.status_code == 200, r.text
    assert _generate(front, ids, "skyrl-up").status_code == 404


def test_skyrl_helper_routes(skyrl_front):
    """The calls SkyRL makes besides loads, with the refusals a fleet must give."""
    url = skyrl_front.url
    r = httpx.post(f"{url}/skyrl/v1/generate", json={"model": "x", "token_ids": [1]})
    assert r.status_code == 400 and "enable_return_routed_experts" in r.text
    r = httpx.post(f"{url}/collective_rpc", json={"method": "skyrl_discard_in_memory_lora"})
    assert r.status_code == 200
    r = httpx.post(f"{url}/collective_rpc", json={"method": "update_weights_nccl"})
    assert r.status_code == 400 and "NCCL" in r.text
    assert httpx.post(f"{url}/finish_session").status_code == 400
    assert httpx.post(f"{url}/finish_session", params={"session_id": "s"}).json() == {"ok": True}
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert r.status_code == 404
    bad = {"model": "tiny", "token_ids": [], "sampling_params": {}}
    r = httpx.post(f"{url}/inference/v1/generate", json=bad)
    assert r.status_code == 400 and "token_ids" in r.text
    ok = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
    r = httpx.post(f"{url}/inference/v1/generate", json=ok, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 2
    assert r.json()["lorafleet"]["adapter"] is None


def test_restart_clears_staged_uploads(tmp_path):
    """A front that restarts finds its predecessor's staged uploads and removes them."""
    from lorafleet.front.uploads import SkyRLUploads

    SkyRLUploads(tmp_path, UploadDirLimits())
    stale = tmp_path / "skyrl-uploads" / str(uuid.uuid4()) / "staging" / "x.partial"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"half an adapter")
    keep = tmp_path / "operator-file"  # the upload dir's other contents are not the front's
    keep.write_text("mine")
    uploads = SkyRLUploads(tmp_path, UploadDirLimits())
    assert not stale.exists() and keep.read_text() == "mine"
    assert list((tmp_path / "skyrl-uploads").iterdir()) == [] and uploads.uploads == {}
