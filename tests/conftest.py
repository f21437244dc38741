"""Make shared test helpers importable as ``helpers.*`` (tests dirs have no ``__init__.py``), the
real-process cluster every module with default flags shares, and the suite's own plugins: a timed-out
test fails alone (helpers.timeout_phases), files sharing a cluster go to one xdist worker
(helpers.xdist_units), and httpx clients share one SSL context (helpers.ssl_context)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.append(_TESTS_DIR)

# Without a GPU, Triton kernels run in Triton's interpreter (numpy on CPU tensors). triton.jit
# reads this when triton is first imported, so it is set here, before any test module imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every node a test starts without --model serves the embedded tiny model (fast, random weights), as
# `--model embedded` would; the few tests of the real default model (tests/real_model/) say so.
os.environ.setdefault("PDSERVE_MODEL", "embedded")

from helpers import timeout_phases, xdist_units  # noqa: E402  (needs the path above)
from helpers.cluster import Proc, pd_cluster, start, static_nodes, wait_idle  # noqa: E402
from helpers.ssl_context import share_default_ssl_context  # noqa: E402

share_default_ssl_context()  # httpx.get / httpx.post: ~15 ms of CPU a call without it


# The files that take longest (seconds of one worker in a `make test` on the 2-core VM), run first:
# `make test` hands whole files (or helpers.xdist_units' groups) to two xdist workers in collection order
# (--no-loadscope-reorder), so one of these started last would leave the other worker idle
# for its whole length. Only the order depends on this list; a stale entry costs nothing.
LONGEST_FIRST = (  # a quiet `make test` of f453383's parent, nodes forked from the zygote
    "tests/real_model/test_real_model_e2e.py",  # 51 s (the real model, fetched once)
    "tests/multihost/test_multihost_partitions.py",  # 35 s; with the rest of the bed's group 46 s
    "tests/test_fidelity_e2e.py",  # 12 s; with the rest of session_cluster's group 34 s
    "tests/test_stall_bounds.py",  # 33 s
    "tests/decode_node/test_tp_disagg.py",  # 29 s
    "tests/proxy/test_migration_drills.py",  # 28 s
    "tests/common/kv_transfer/test_kvt_failures.py",  # 21 s
    "tests/proxy/test_fallbacks_e2e.py",  # 21 s
    "tests/test_launcher_e2e.py",  # 19 s
    "tests/deploy/test_fresh_install.py",  # 18 s
    "tests/decode_node/test_kv_transfer_params.py",  # 18 s
    "tests/proxy/test_proxy_relay.py",  # 15 s
    "tests/bench/test_ttft_parity.py",  # 15 s
    "tests/proxy/test_planner_e2e.py",  # 14 s
    "tests/proxy/test_proxy_http_surface.py",  # 14 s
    "tests/common/kv_transfer/test_kvt_engine.py",  # 14 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(timeout_phases, "pdserve-timeout-phases")  # a timed-out test fails alone
    config.pluginmanager.register(xdist_units, "pdserve-xdist-units")  # shared clusters: one worker each


@pytest.fixture(scope="session")
def session_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    """One proxy (the daemons' registry; default flags, but it logs at debug, where its prefill
    decisions are) + prefill + decode + colocated node on default flags, started once for every
    module that needs nothing else (see ``shared_cluster``). A module that needs other proxy flags
    puts a proxy of its own in front of the same daemons (``helpers.cluster.static_nodes``)."""
    with pd_cluster(tmp_path_factory.mktemp("shared-cluster"), ("--log-level", "debug")) as procs:
        yield procs


# A request the decode node refuses can leave its KV on the prefill node until the KV lease
# (--kv-lease-s, 30 s) ends it, so idleness is awaited a while longer than that.
IDLE_TIMEOUT_S = 60.0


@pytest.fixture
def shared_cluster(session_cluster: dict[str, Proc]) -> Iterator[dict[str, Proc]]:
    """``session_cluster`` for one test, which must leave it as found: nothing running, no KV
    block held (checked after the test), no node stopped (tests that kill nodes start their own)."""
    yield session_cluster
    for role in ("prefill", "decode", "both"):
        wait_idle(session_cluster[role].url, timeout=IDLE_TIMEOUT_S)


@pytest.fixture(scope="module")
def always_proxy(session_cluster: dict[str, Proc], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """A proxy of the module's own with --disagg-policy always in front of ``session_cluster``'s daemons:
    every prompt is prefilled on the prefill node, so a grammar must cross the hand-over."""
    proxy = start("proxy", tmp_path_factory.mktemp("always-proxy"), *static_nodes(session_cluster),
                  "--disagg-policy", "always")
    yield proxy
    proxy.stop()
