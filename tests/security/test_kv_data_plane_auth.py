"""Strangers on a real prefill daemon's tcp data port (issue 22 item 3), with and without a
cluster key: each is closed, writes nothing, and does not hold up the honest consumer connecting
beside it; with a key, a peer holding another key builds no pair (both sides say so); the next
honest transfer's bytes equal the one made before the strangers came."""

from __future__ import annotations

import json
import os
import socket
import uuid
from pathlib import Path

import httpx
import pytest
import torch

from common.cluster_auth import SIGNATURE_HEADER, ClusterKey, control_sealer
from common.kv_transfer.config import PairBrokenError, TransferConfig
from common.kv_transfer.endpoint import KVEndpoint
from common.kv_transfer.messages import Handshake, HandshakeOk, decode, encode
from common.kv_transfer.pair_auth import CHALLENGE_MAGIC, NONCE_BYTES
from common.kv_transfer.tcp_pair import TcpPair
from common.kv_transfer.transport import Endpoint
from common.model.config import ModelConfig
from common.model.embedded import ensure_embedded_model
from common.request_id import make_request_id
from helpers.cluster import start
from helpers.kv_pull import pull_into_blocks
from helpers.waiting import wait_for
from helpers.zmq_peer import raw_dealer

PROMPT = list(range(40, 60))  # 20 tokens: 2 blocks of 16


@pytest.fixture(scope="module")
def layout():
    return ModelConfig.from_dir(ensure_embedded_model(Path("~/.cache/pdserve/models").expanduser())).kv_layout(
        16, "float32")


def _transfer(prefill, key: ClusterKey | None, layout) -> list[torch.Tensor]:
    """One honest transfer of PROMPT's KV into blocks 1 and 2 of a fresh cache."""
    with KVEndpoint("127.0.0.1:0", layout, TransferConfig(timeout_s=5.0), key=key) as consumer:
        rid = make_request_id(prefill.kv_addr, consumer.address, uuid.uuid4().hex)
        body = json.dumps({"model": "pdserve-tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}).encode()
        headers = {"X-Request-Id": rid, "Content-Type": "application/json"}
        if key is not None:
            headers[SIGNATURE_HEADER] = key.sign_id(rid, "prefill", body)
        r = httpx.post(prefill.url + "/v1/completions", content=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return pull_into_blocks(consumer, prefill, rid, len(PROMPT), layout, [1, 2])


def _open_port(prefill, key: ClusterKey | None, layout, pair_id: str) -> int:
    """Ask the prefill daemon for a pair over the control plane (as its consumer would): the port."""
    hello = Handshake(id=1, pair_id=pair_id, layout=layout.to_dict(), backend="tcp",
                      endpoint=Endpoint.local("cpu").to_dict())
    sealer = control_sealer(key)
    with raw_dealer(prefill.kv_addr) as dealer:
        dealer.send_multipart(sealer.frames(encode(hello)))
        assert dealer.poll(10_000), prefill.log_tail()
        payload, reason = sealer.open(dealer.recv_multipart())
    reply = decode(payload)
    assert reason is None and isinstance(reply, HandshakeOk), (reason, reply)
    return reply.store_port


def _stranger(port: int, payload: bytes, keyed: bool) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if keyed:  # the producer speaks first: its challenge
        assert s.recv(len(CHALLENGE_MAGIC) + NONCE_BYTES, socket.MSG_WAITALL).startswith(CHALLENGE_MAGIC)
    s.sendall(payload)
    return s


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(4096) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "keyless"])
def test_strangers_on_the_data_port_are_closed_and_write_nothing(tmp_path, layout, keyed):
    key = ClusterKey.load(ClusterKey.generate(tmp_path / "cluster.key")) if keyed else None
    args = ("--cluster-key-file", str(tmp_path / "cluster.key")) if keyed else ()
    # no prefix caching: the second transfer recomputes the prompt, so its bytes must equal the first's
    prefill = start("prefill", tmp_path, *args, "--kv-transport", "tcp", "--no-enable-prefix-caching")
    try:
        before = _transfer(prefill, key, layout)
        pair_id = uuid.uuid4().hex
        port = _open_port(prefill, key, layout, pair_id)
        forged = pair_id.encode() + os.urandom(NONCE_BYTES + 32) if keyed else uuid.uuid4().hex.encode()
        strangers = [_stranger(port, b"", keyed),  # silent: connected first, never says a word
                     _stranger(port, os.urandom(256), keyed),  # garbage
                     _stranger(port, forged, keyed)]  # the pair id in the clear with a made-up proof
        if keyed:  # a daemon with another key: the producer closes it, and it says why
            with pytest.raises(PairBrokenError, match="does not hold our key"):
                TcpPair(1, 5.0, pair_id, host="127.0.0.1", port=port, connect_timeout_s=10.0,
                        key=ClusterKey(os.urandom(32)))
        # the honest consumer joins behind them all, while the silent one still holds its connection
        honest = TcpPair(1, 5.0, pair_id, host="127.0.0.1", port=port, connect_timeout_s=10.0, key=key)
        assert all(_closed(s) for s in strangers)  # the port closes once ours is in
        honest.close()
        for s in strangers:
            s.close()
        if keyed:
            assert wait_for(lambda: "failed the cluster-key proof" in prefill.log_tail(200), 10), prefill.log_tail()

        after = _transfer(prefill, key, layout)
        assert all(torch.count_nonzero(x[:, 1:3]) > 0 for x in before)
        assert all(torch.equal(a, b) for a, b in zip(before, after))  # exact: nothing of theirs landed
    finally:
        prefill.stop()
