"""A local three-node Ray cluster for the ``lorafleet.ray`` tests (skipped without the extra).

Every node is this machine bound to 127.0.0.1 with two CPUs and a 200 MB object store; the
dashboard is off. Ray resolves a loopback address to the host's outward one unless told that
this is not a real cluster (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``), and its temp directory is
a short private one (socket paths must fit 107 bytes; nothing shared with another Ray on the box).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

NODES = 3
NODE_ARGS = {
    "num_cpus": 2,
    "node_ip_address": "127.0.0.1",
    "object_store_memory": 200 * 1024 * 1024,
}
_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[object]:
    """The cluster, with this process connected to it as a driver."""
    saved = {k: os.environ.get(k) for k in (*_ENV, "RAY_TMPDIR")}
    os.environ.update(_ENV)  # before ray is imported: read at import
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="lfray", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    os.makedirs(f"{tmp}/ray")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**NODE_ARGS, "include_dashboard": False, "temp_dir": f"{tmp}/ray"},
    )
    try:
        for _ in range(NODES - 1):
            cluster.add_node(**NODE_ARGS)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def ray_workdir(tmp_path_factory) -> str:
    """Where the fleets' logs, stores and router state go (on every node: one machine here)."""
    return str(tmp_path_factory.mktemp("ray-fleets"))


@pytest.fixture(scope="session")
def adapters(tiny_model, tmp_path_factory):
    from lorafleet.testing import make_peft_adapter

    root = tmp_path_factory.mktemp("ray-adapters")
    return {
        "a": make_peft_adapter(tiny_model, root / "a", r=8, seed=11),
        "b": make_peft_adapter(tiny_model, root / "b", r=8, seed=12),
    }
