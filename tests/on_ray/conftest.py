"""A local three-node Ray cluster for the ``lorafleet.ray`` tests (skipped without the extra):
``lorafleet.testing.raycluster``, every node this machine on 127.0.0.1."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

from lorafleet.testing.raycluster import RAY_ENV

# Ray reads these when it is first imported, by whichever test module does it first.
os.environ.update(RAY_ENV)

NODES = 3


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[object]:
    """The cluster (2 CPUs and a 200 MiB object store per node), this process its driver.
    Stopped after this package's last test: idle, its daemons still take a tenth of a core."""
    if importlib.util.find_spec("ray") is None:  # not imported here: see local_cluster
        pytest.skip("the ray extra is not installed")
    from lorafleet.testing.raycluster import local_cluster

    with local_cluster(NODES, num_cpus=2, object_store_mib=200) as cluster:
        yield cluster


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
