"""How ``make test`` hands tests to its two xdist workers (a pytest plugin; tests/conftest.py registers it).

``--dist loadfile`` gives a worker a whole file at a time, so a module-scoped cluster starts once. A
package- or session-scoped cluster starts once per *worker*: split over both, it starts twice. The
files that share one go to a worker together, as one unit (in the baseline run the multi-host bed,
7 processes in 6 network namespaces, started on both workers: 16.9 s and 19.3 s; so did the
4-process session cluster). A file missing here still passes, on a cluster of its worker's own.
"""

from __future__ import annotations

import pytest

SHARED_CLUSTER_FILES = {
    "the multi-host bed": ("tests/multihost/",),
    "session_cluster": ("tests/test_fidelity_e2e.py", "tests/test_tool_calls_e2e.py",
                        "tests/test_structured_output_e2e.py", "tests/proxy/test_adaptive_disagg.py",
                        "tests/proxy/test_proxy_e2e.py", "tests/security/test_stranger_producer.py",
                        "tests/security/test_bad_input_matrix.py"),
}


def unit_of(path: str) -> str:
    """The unit a test file goes to a worker in: its group's name, or the file itself."""
    return next((unit for unit, prefixes in SHARED_CLUSTER_FILES.items() if path.startswith(prefixes)), path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadfile`` with the files of ``SHARED_CLUSTER_FILES`` as one unit each."""
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own
    from xdist.scheduler import LoadFileScheduling

    class SharedClusterScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(super()._split_scope(nodeid))

    return SharedClusterScheduling(config, log)
