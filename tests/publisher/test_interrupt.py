"""Ctrl-C in a trainer mid-publication: ``publish()`` re-raises only after the rollback is done.

The trainer is a real subprocess that takes a real SIGINT while its upload is in flight. Right
after ``publish()`` raises ``KeyboardInterrupt`` (before the Publisher is closed) it looks at the
router and the agents: the lease is free, nothing of the interrupted version, no staged bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from lorafleet.publisher import Publisher
from lorafleet.testing import ALL_LINEAR, make_peft_adapter

TRAINER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path

    import httpx

    from lorafleet.publisher import Publisher

    args = json.loads(sys.argv[1])
    interrupted = []
    # Ctrl-C raises KeyboardInterrupt, as in a terminal. A process started in the background by
    # a non-interactive shell (a CI job under nohup, `cmd &`) inherits SIGINT ignored, and Python
    # then leaves it ignored: the interrupt would never arrive.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def on_progress(replica, sent, total):
        if not interrupted and 0 < sent < total:
            interrupted.append(replica)
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as the terminal sends it
            time.sleep(0.5)  # hold the upload here while the main thread takes the interrupt

    pub = Publisher(args["agents"], router=args["router"], token=args["token"],
                    on_progress=on_progress)
    try:
        pub.publish(args["adapter"], name="policy")
        outcome = "published"
    except KeyboardInterrupt:
        outcome = "interrupted"
    auth = {"Authorization": "Bearer " + args["token"]}
    # First the lease: the publication releases it last, after its rollback.
    lease = args["router"] + "/v1/control/leases/policy"
    lease_free = httpx.post(lease, headers=auth, json={"holder": "probe", "ttl_s": 60}).is_success
    httpx.delete(lease + "/probe", headers=auth)
    held = [
        sorted(a["version"] for a in httpx.get(u + "/v1/adapters", headers=auth).json()["adapters"])
        for u in args["agents"]
    ]
    staging = [
        sum(f.stat().st_size for f in (Path(d) / "staging").rglob("*") if f.is_file())
        for d in args["data_dirs"]
    ]
    seen = {"outcome": outcome, "lease_free": lease_free, "held": held, "staging": staging,
            "signalled": bool(interrupted)}
    print(json.dumps(seen), flush=True)
    pub.close()
    """
)


def test_ctrl_c_rolls_back_before_publish_raises(launcher, make_fleet, tiny_model, tmp_path):
    fleet = make_fleet(launcher, 2)
    small = make_peft_adapter(tiny_model, tmp_path / "small", r=8, seed=91)
    large = make_peft_adapter(
        tiny_model, tmp_path / "large", r=64, seed=92, target_modules=ALL_LINEAR
    )
    with Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token) as pub:
        pub.publish(str(small), name="policy")
    args = {
        "agents": fleet.agent_urls,
        "router": fleet.router.url,
        "token": fleet.token,
        "adapter": str(large),
        "data_dirs": [str(a.spec.data_dir) for a in fleet.agents],
    }
    proc = subprocess.run(
        [sys.executable, "-c", TRAINER, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {
        "outcome": "interrupted",
        "lease_free": True,
        "held": [[1], [1]],
        "staging": [0, 0],
        "signalled": True,  # False: no progress report fell inside the upload
    }, proc.stderr
    assert fleet.staging_bytes() == [0, 0]
    # and the next publication goes through
    with Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token) as pub:
        assert pub.publish(str(large), name="policy").version == 2
