"""Strangers' handshakes cannot grow a prefill daemon without bound (issue 22, finding 4):
pairs are capped (``--kv-max-pairs``) and ones nobody joins or uses are closed, so its
threads and file descriptors stay bounded and an honest transfer still works after."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import httpx
import pytest
import torch

from common.kv_transfer.config import TransferConfig
from common.kv_transfer.endpoint import KVEndpoint
from common.kv_transfer.messages import Error, Handshake, HandshakeOk, decode, encode
from common.kv_transfer.transport import Endpoint
from common.model.config import ModelConfig
from common.model.embedded import ensure_embedded_model
from common.request_id import make_request_id
from helpers.cluster import start
from helpers.kv_pull import pull_into_blocks
from helpers.waiting import wait_for
from helpers.zmq_peer import raw_dealer

MAX_PAIRS = 8
STRANGERS = 100


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture(scope="module")
def layout():
    return ModelConfig.from_dir(ensure_embedded_model(Path("~/.cache/pdserve/models").expanduser())).kv_layout(
        16, "float32")


def test_stranger_handshakes_leave_threads_and_fds_bounded(tmp_path, layout):
    prefill = start("prefill", tmp_path, "--kv-max-pairs", str(MAX_PAIRS), "--kv-connect-timeout-s", "2")
    try:
        pid = prefill.popen.pid
        threads, fds = _threads(pid), _fds(pid)
        replies: list = []
        with raw_dealer(prefill.kv_addr) as stranger:
            for i in range(STRANGERS):  # each a new pair the stranger never joins
                hello = Handshake(id=i + 1, pair_id=uuid.uuid4().hex, layout=layout.to_dict(), backend="tcp",
                                  endpoint=Endpoint.local("cpu").to_dict())
                stranger.send(encode(hello))
            while len(replies) < STRANGERS and stranger.poll(10_000):
                replies.append(decode(stranger.recv()))
            peak_threads, peak_fds = _threads(pid), _fds(pid)
        opened = sum(isinstance(r, HandshakeOk) for r in replies)
        refused = [r.reason for r in replies if isinstance(r, Error)]
        assert len(replies) == STRANGERS and opened <= MAX_PAIRS, (opened, refused[:1])
        assert all("--kv-max-pairs" in why for why in refused), refused[:3]
        assert peak_threads <= threads + MAX_PAIRS + 2, (peak_threads, threads)
        assert peak_fds <= fds + 4 * MAX_PAIRS + 8, (peak_fds, fds)
        # pairs nobody joined end at --kv-connect-timeout-s: back to where it started
        assert wait_for(lambda: _threads(pid) <= threads + 1, 30), (_threads(pid), threads)
        assert wait_for(lambda: _fds(pid) <= fds + 4, 30), (_fds(pid), fds)

        with KVEndpoint("127.0.0.1:0", layout, TransferConfig(timeout_s=5.0)) as consumer:
            prompt = list(range(40, 60))  # 20 tokens: 2 blocks
            rid = make_request_id(prefill.kv_addr, consumer.address, "honest")
            body = {"model": "pdserve-tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
            r = httpx.post(prefill.url + "/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=60)
            assert r.status_code == 200, r.text
            kv = pull_into_blocks(consumer, prefill, rid, len(prompt), layout, [1, 2])
            assert torch.count_nonzero(kv[0][:, 1:3]) > 0  # the prompt's KV landed in blocks 1 and 2
    finally:
        prefill.stop()
