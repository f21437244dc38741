"""A test past pyproject's ``timeout`` fails alone, named, and the run goes on (a pytest plugin;
tests/conftest.py registers it).

pytest-timeout's signal method raises ``pytest.fail`` wherever SIGALRM finds the main thread. Inside
setup, call or teardown pytest reports that as the test's failure, and the test's fixtures still stop
its processes. Between them (making a report, sending it to the xdist controller) it escapes as an
INTERNALERROR: the worker stops, the rest of its tests never run, and the session exits 3 without the
failures' names (a probe whose report hook was busy past a 5 s timeout: 3 of 9 tests never ran). So
the alarm fails the test only inside a phase, and otherwise comes back 0.1 s later.

The thread method is no way out: it ``os._exit()``s the worker, leaving the test's processes running,
and under ``--dist loadfile`` xdist hands the timed-out test's file to each replacement worker in
turn (a 5 s probe hung the run past 300 s).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import pytest
import pytest_timeout

_IN_PHASE = pytest.StashKey[bool]()


def _in_phase(item: pytest.Item) -> Iterator[None]:
    item.stash[_IN_PHASE] = True
    try:
        return (yield)
    finally:
        item.stash[_IN_PHASE] = False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _in_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _in_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    return (yield from _in_phase(item))


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: pytest_timeout.Settings) -> bool | None:
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None  # pytest-timeout's own timer

    def on_alarm(signum: int, frame: object) -> None:
        if item.stash.get(_IN_PHASE, False):
            pytest_timeout.timeout_sigalrm(item, settings)  # prints every thread's stack, fails the test
        else:
            signal.setitimer(signal.ITIMER_REAL, 0.1)

    def cancel() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    item.cancel_timeout = cancel  # type: ignore[attr-defined]  (pytest-timeout's cancel hook calls it)
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    return True
