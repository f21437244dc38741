"""A daemon bound to 0.0.0.0 without ``--kv-host`` tells the proxy an address others can reach.

Registering 127.0.0.1 would make it unreachable from any other host; instead it registers
the host's routable address and says so in its log (the refusal, for a host with nothing
but loopback, is in test_config_loading.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest
import zmq

from common.config import routable_host
from helpers.cluster import start


def _first_registration(router: zmq.Socket, deadline_s: float) -> dict:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if router.poll(200):
            for frame in router.recv_multipart()[1:]:  # [identity, payload, (seal)]
                try:
                    message = msgpack.unpackb(frame)
                except (ValueError, msgpack.UnpackException):
                    continue
                if isinstance(message, dict) and "http_address" in message:
                    return message
    raise AssertionError("no registration arrived")


@pytest.mark.slow
def test_a_daemon_on_all_interfaces_registers_its_routable_address(tmp_path: Path) -> None:
    address = routable_host()
    if address is None:
        pytest.skip("this host has only loopback: the daemon refuses to start (see test_config_loading.py)")
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)  # stands in for the proxy's registry
    port = router.bind_to_random_port("tcp://127.0.0.1")
    # keyless on every interface: refused without --insecure-keyless-network (tests/security/test_keyless_network.py)
    node = start("decode", tmp_path, "--host", "0.0.0.0", "--proxy", f"127.0.0.1:{port}",
                 "--insecure-keyless-network", wait=False)
    try:
        message = _first_registration(router, deadline_s=120)
        assert message["http_address"] == f"{address}:{node.port}"
        assert message["zmq_address"] == f"{address}:{node.kv_port}"
        node.wait_ready()
        assert f"peers and the proxy are told {address}" in node.log.read_text()
    finally:
        node.stop()
        router.close(linger=0)
        context.term()
