from __future__ import annotations

import threading
import time

import pytest

from common.kv_layout import KVLayout

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=4, dtype="bfloat16")
FAST = {"timeout_s": 2.0, "lease_s": 5.0, "handshake_timeout_s": 5.0, "connect_timeout_s": 5.0, "heartbeat_s": 0.3}


@pytest.fixture
def layout() -> KVLayout:
    return LAYOUT


@pytest.fixture
def fast() -> dict:
    return dict(FAST)


@pytest.fixture
def no_thread_leak():
    """Fails the test if it leaves threads behind."""
    before = {t.ident for t in threading.enumerate()}
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
        if not extra:
            return
        time.sleep(0.05)
    pytest.fail(f"leaked threads: {[t.name for t in extra]}")
