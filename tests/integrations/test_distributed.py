"""``lorafleet.integrations.distributed.publish`` under ``torchrun --nproc-per-node 2`` (gloo, CPU).

Each wrapping runs once as a real two-process job (tests/integrations/dist_worker.py) against a
real local fleet; the tests then read what every rank returned or raised and what was
materialised while it published.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("transformers")

from lorafleet.fleet.config import FleetConfig, ReplicaConfig
from lorafleet.fleet.local import LocalFleet
from lorafleet.launch import reserve_port

WORKER = Path(__file__).with_name("dist_worker.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")
MAX_LORA_RANK = 16  # the worker's second adapter has rank 32: the replica refuses it
LORA_TENSORS = 2 * 4 * 2  # lora_A and lora_B x q/k/v/o x 2 layers of the tiny model
JOB_TIMEOUT = 420


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory):
    config = FleetConfig(
        replicas=(ReplicaConfig(max_lora_rank=MAX_LORA_RANK),),
        data_dir=tmp_path_factory.mktemp("fleet"),
    )
    with LocalFleet(config) as f:
        yield f


def torchrun(fleet: LocalFleet, out: Path, *args: str) -> list[dict]:
    """Run the worker on 2 ranks on loopback; return each rank's report (rank order)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "LORAFLEET_TEST_AGENTS": ",".join(fleet.agent_urls),
        "LORAFLEET_TEST_ROUTER": fleet.router_url,
        "LORAFLEET_TEST_TOKEN": fleet.token,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }
    argv = [
        str(TORCHRUN),
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(reserve_port()),
        str(WORKER),
        "--out",
        str(out),
        *args,
    ]
    log = out / "torchrun.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(
                f"torchrun job hung (a rank waited forever); log: {log.read_text()[-4000:]}"
            )
    reports = []
    for rank in (0, 1):
        path = out / f"rank{rank}.json"
        assert path.is_file(), f"rank {rank} wrote no report; log: {log.read_text()[-4000:]}"
        reports.append(json.loads(path.read_text()))
    assert proc.returncode == 0, ([r.get("crash") for r in reports], log.read_text()[-4000:])
    return reports


@pytest.fixture(scope="module", params=["fsdp2", "fsdp1", "ddp"])
def job(request, fleet: LocalFleet, tmp_path_factory) -> tuple[str, list[dict], Path]:
    wrap = request.param
    out = tmp_path_factory.mktemp(f"job-{wrap}")
    return wrap, torchrun(fleet, out, "--wrap", wrap, "--name", f"dist-{wrap}"), out


def last_version(rank0: dict) -> int:
    """The version the job published last (the DDP job ends with a state-dict publication)."""
    return rank0.get("state_dict", rank0["publish"])["version"]


def routed_ids(fleet: LocalFleet, name: str, prompt: str) -> tuple[list[int], int]:
    r = httpx.post(
        fleet.router_url + "/v1/completions",
        headers={"Authorization": f"Bearer {fleet.api_key}"},
        json={"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
              "return_token_ids": True},
        timeout=60,
    )  # fmt: skip
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["token_ids"], body["lorafleet"]["version"]


def test_routed_output_equals_the_merged_weights_of_the_sharded_adapter(
    job, fleet: LocalFleet, tiny_model: Path
) -> None:
    from lorafleet.testing import merged_greedy_ids

    wrap, (rank0, rank1), out = job
    assert rank0["publish"]["ok"], rank0["publish"]
    # Every rank returns the same result.
    assert rank0["publish"] == rank1["publish"]
    prompt = "The quick brown fox"
    # The reference is the trained adapter as torch's own full state dict saw it, saved by PEFT.
    expected = merged_greedy_ids(tiny_model, out / "adapter", prompt, max_tokens=8)
    ids, version = routed_ids(fleet, f"dist-{wrap}", prompt)
    assert ids == expected
    assert version == last_version(rank0)
    base_ids = merged_greedy_ids(tiny_model, None, prompt, max_tokens=8)
    assert ids != base_ids  # the adapter changes the output: the comparison means something


def test_only_lora_parameters_are_materialised(job) -> None:
    wrap, reports, _out = job
    for report in reports:
        seen = report["materialised"]
        lora = set(report["lora_params"])
        assert seen["fsdp2_unshard"] == 0  # FSDP2 never unsharded a whole layer
        if wrap == "fsdp2":
            # Each rank read its own shard of every LoRA parameter and of nothing else; one
            # gather moved them (the tiny model's LoRA rows split evenly: no padding).
            assert set(seen["to_local"]) == lora and len(lora) == LORA_TENSORS
            assert seen["gather_numel"] * 2 == report["lora_numel"]
            assert seen["full_tensor"] == [] and seen["fsdp1_unshard"] == []
            # The fallback (one full_tensor() per parameter) materialises the same, alone.
            unbatched = report["unbatched"]
            assert unbatched["same_tensors"]
            names = [n for n, _numel in unbatched["materialised"]["full_tensor"]]
            assert sorted(names) == sorted(lora)
            assert (
                sum(n for _name, n in unbatched["materialised"]["full_tensor"])
                == (report["lora_numel"])
            )
            assert unbatched["materialised"]["fsdp2_unshard"] == 0
        elif wrap == "fsdp1":
            assert seen["full_tensor"] == [] and seen["gather_numel"] == 0
            units = seen["fsdp1_unshard"]
            assert len(units) == LORA_TENSORS  # one unit per LoRA matrix, each gathered once
            for _path, fqns, _numel in units:
                assert fqns == ["weight"] and ".lora_" in _path, (_path, fqns)
            gathered = sorted(p.replace("_fsdp_wrapped_module.", "") + ".weight" for p, *_ in units)
            assert gathered == sorted(lora)
        else:  # DDP: every rank holds the adapter; nothing is gathered at all
            assert seen == {
                "full_tensor": [],
                "to_local": [],
                "gather_numel": 0,
                "fsdp2_unshard": 0,
                "fsdp1_unshard": [],
            }


def test_a_refusal_on_rank0_raises_the_same_error_on_every_rank(job, fleet: LocalFleet) -> None:
    wrap, (rank0, rank1), _out = job
    refused = rank0["refused"]
    assert not refused["ok"]
    assert refused["type"] == "PublishError", refused["trace"]
    assert f"greater than max_lora_rank {MAX_LORA_RANK}" in refused["message"]  # the agent said
    assert refused["failures"]  # replica -> reason
    other = rank1["refused"]
    assert (other["type"], other["message"], other["failures"]) == (
        refused["type"],
        refused["message"],
        refused["failures"],
    )
    # Atomic mode: the refused version left nothing behind; the published one still serves.
    _ids, version = routed_ids(fleet, f"dist-{wrap}", "Hello")
    assert version == last_version(rank0)


def test_no_publisher_on_rank0_raises_everywhere(job) -> None:
    _wrap, (rank0, rank1), _out = job
    for report in (rank0, rank1):
        err = report["no_publisher"]
        assert not err["ok"] and err["type"] == "ValueError"
        assert "needs a Publisher" in err["message"]


def test_a_state_dict_on_rank0_publishes_for_every_rank(job, fleet: LocalFleet) -> None:
    wrap, (rank0, rank1), _out = job
    if wrap != "ddp":
        pytest.skip("run once, in the DDP job")
    assert rank0["state_dict"]["ok"], rank0["state_dict"]
    assert rank0["state_dict"] == rank1["state_dict"]
    assert rank0["state_dict"]["version"] == rank0["publish"]["version"] + 1
    _ids, version = routed_ids(fleet, "dist-ddp", "Hello")
    assert version == rank0["state_dict"]["version"]


def test_fsdp1_unit_mixing_base_and_lora_is_refused_before_any_gather(job) -> None:
    wrap, (rank0, rank1), _out = job
    if wrap != "fsdp1":
        pytest.skip("run once, in the FSDP1 job")
    for report in (rank0, rank1):
        err = report["mixed"]
        assert not err["ok"] and err["type"] == "ValueError"
        assert "base weights beside adapter weights" in err["message"]
        assert err["materialised"]["fsdp1_unshard"] == []  # refused before gathering anything
    assert rank0["mixed"]["message"] == rank1["mixed"]["message"]


def test_trainer_callback_publishes_collectively_when_distributed(
    fleet: LocalFleet, tiny_model: Path, tmp_path: Path
) -> None:
    from lorafleet.testing import merged_greedy_ids

    rank0, rank1 = torchrun(fleet, tmp_path, "--trainer", "--name", "dist-trainer")
    assert rank0["wrapped"] == "DistributedDataParallel"  # the Trainer really ran distributed
    # Step 2, then the end of training (step 3), on both ranks alike.
    for report in (rank0, rank1):
        assert report["versions"] == [1, 2]
        assert report["logged"] == [[2, 1], [3, 2]]
    assert rank0["digests"] == rank1["digests"]
    prompt = "The quick brown fox"
    ids, version = routed_ids(fleet, "dist-trainer", prompt)
    assert version == 2
    assert ids == merged_greedy_ids(tiny_model, tmp_path / "adapter", prompt, max_tokens=8)
