"""A forged or stale id costs nothing (issue 11, "what was seen" 3), even without a key:
connections to peers that never answer are closed and their threads end; a decode node
opens no connection for a request it refuses; prefill caps KV nobody asked for."""

from __future__ import annotations

import os
import select
import socket
import threading

import httpx
import pytest
import torch

from common.kv_layout import KVLayout
from common.kv_transfer.config import TransferConfig
from common.kv_transfer.endpoint import KVEndpoint
from common.request_id import make_request_id
from helpers.cluster import start
from helpers.ports import free_port
from helpers.waiting import wait_for

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _closed_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())  # bound then closed: nothing listens there
    return sorted(ports)



def test_200_unreachable_peers_leave_no_thread_or_fd():
    config = TransferConfig(timeout_s=1.0, handshake_timeout_s=1.0, lease_s=5.0, heartbeat_s=0.3,
                            peer_idle_s=1.0)
    engine = KVEndpoint("127.0.0.1:0", LAYOUT, config)
    kv_caches = [torch.zeros(LAYOUT.layer_shape(4)) for _ in range(LAYOUT.num_layers)]
    try:
        threads, fds = threading.active_count(), _fds()
        failed: dict[str, str] = {}
        for i, port in enumerate(_closed_ports(200)):
            engine.consumer.request(f"forged-{i}", f"127.0.0.1:{port}", [0], 1, kv_caches)

        def all_failed() -> bool:
            failed.update(engine.consumer.poll_finished()[1])
            return len(failed) == 200

        assert wait_for(all_failed, 60), f"{len(failed)} of 200 transfers failed"
        assert wait_for(lambda: threading.active_count() <= threads, 30), (
            f"threads: {threading.active_count()} vs {threads} before")
        assert wait_for(lambda: _fds() <= fds, 30), f"file descriptors: {_fds()} vs {fds} before"
    finally:
        engine.close()


def test_receiver_threads_are_capped_at_max_peers():
    config = TransferConfig(timeout_s=1.0, handshake_timeout_s=1.0, heartbeat_s=0.3, max_peers=8)
    engine = KVEndpoint("127.0.0.1:0", LAYOUT, config)
    kv_caches = [torch.zeros(LAYOUT.layer_shape(4)) for _ in range(LAYOUT.num_layers)]
    try:
        threads = threading.active_count()
        for i, port in enumerate(_closed_ports(20)):
            engine.consumer.request(f"forged-{i}", f"127.0.0.1:{port}", [0], 1, kv_caches)
        assert threading.active_count() <= threads + 8
        refused = engine.consumer.poll_finished()[1]
        assert len(refused) == 12 and all("already in use" in why for why in refused.values())
    finally:
        engine.close()


@pytest.fixture(scope="module")
def keyless(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("keyless")
    # a small prefill cache: 64 blocks of 16 tokens, at most a quarter held for unclaimed requests
    prefill = start("prefill", tmp, "--num-kv-blocks", "64", "--max-unclaimed-kv-share", "0.25", wait=False)
    decode = start("decode", tmp, wait=False)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


def test_decode_opens_no_connection_for_a_request_it_refuses(keyless):
    _, decode = keyless
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(16)
    try:
        forged = make_request_id(f"127.0.0.1:{trap.getsockname()[1]}", "127.0.0.1:1")
        body = {"prompt": "hello", "max_tokens": 10**9}  # refused: longer than the model allows
        r = httpx.post(f"{decode.url}/v1/completions", json=body, headers={"X-Request-Id": forged},
                       timeout=30)
        assert r.status_code == 400, r.text
        assert not select.select([trap], [], [], 1.5)[0], "decode connected to the address in a refused id"
    finally:
        trap.close()


def test_prefill_caps_kv_held_for_requests_nobody_asked_for(keyless):
    prefill, _ = keyless
    body = {"prompt": list(range(10, 170)), "max_tokens": 1}  # 160 tokens = 10 blocks; the cap is 16
    statuses = []
    for _ in range(3):  # ids naming a decode node that will never ask for the KV
        forged = make_request_id(prefill.kv_addr, "127.0.0.1:1")
        r = httpx.post(f"{prefill.url}/v1/completions", json=body, headers={"X-Request-Id": forged},
                       timeout=60)
        statuses.append(r.status_code)
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "unclaimed_kv_limit"
    assert statuses == [200, 503, 503]
