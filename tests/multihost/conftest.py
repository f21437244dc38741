"""One 2P2D cluster across network namespaces (see mh_cluster.py), shared by every
multi-host test; skipped with the reason where namespaces cannot be created."""

from __future__ import annotations

import pytest
from mh_cluster import start_cluster, stop_cluster

from helpers.netns import unavailable


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    reason = unavailable()
    if reason:
        pytest.skip(f"multi-host bed unavailable: {reason}")
    c = start_cluster(tmp_path_factory.mktemp("multihost"))
    try:
        yield c
    finally:
        stop_cluster(c.bed, c.colocated)
