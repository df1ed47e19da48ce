"""A local multi-node Ray cluster on this machine, every node bound to 127.0.0.1 (tests, benches).

Ray resolves a loopback address to the host's outward one unless told that this is not a real
cluster (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read when ``ray`` is imported), and its temp
directory must be short (socket paths must fit 107 bytes) and private (nothing shared with
another Ray on the box). The dashboard is off.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

__all__ = ["RAY_ENV", "local_cluster"]

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


@contextlib.contextmanager
def local_cluster(
    nodes: int = 3, *, num_cpus: int = 2, object_store_mib: int = 200, **node_args: Any
) -> Iterator[Any]:
    """``nodes`` Ray nodes on 127.0.0.1 (a ``ray.cluster_utils.Cluster``), with this process
    connected as a driver; everything is shut down and the environment restored on exit.

    ``cluster.node_args`` holds the nodes' arguments, for ``cluster.add_node(**node_args)``."""
    saved = {k: os.environ.get(k) for k in (*RAY_ENV, "RAY_TMPDIR")}
    os.environ.update(RAY_ENV)  # before ray is imported
    tmp = tempfile.mkdtemp(prefix="lfray", dir="/tmp")
    try:
        import ray
        from ray.cluster_utils import Cluster

        os.environ["RAY_TMPDIR"] = tmp
        os.makedirs(f"{tmp}/ray")
        args = {
            "num_cpus": num_cpus,
            "node_ip_address": "127.0.0.1",
            "object_store_memory": object_store_mib * 1024 * 1024,
            **node_args,
        }
        cluster = Cluster(
            initialize_head=True,
            head_node_args={**args, "include_dashboard": False, "temp_dir": f"{tmp}/ray"},
        )
        cluster.node_args = args
        try:
            for _ in range(nodes - 1):
                cluster.add_node(**args)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False)
            try:
                yield cluster
            finally:
                ray.shutdown()
        finally:
            cluster.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
