"""Waiting on a condition with a deadline: what a test does instead of sleeping."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], object], timeout: float = 5.0, step: float = 0.01) -> bool:
    """Whether ``predicate()`` turned true within ``timeout`` seconds (looked at every ``step``)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(step)
    return bool(predicate())


def wait_until(condition: Callable[[], object], what: str, timeout: float = 30.0, step: float = 0.02) -> None:
    """Until ``condition()`` is true; fails naming ``what`` after ``timeout`` seconds."""
    assert wait_for(condition, timeout, step), f"not within {timeout:g} s: {what}"
