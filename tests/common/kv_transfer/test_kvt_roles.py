"""A prefill node's KV endpoint builds only the producer half, a decode node's only the consumer
half: the other half's threads, tables and sockets do not exist, and a peer that asks the wrong
half is told so at once instead of waiting out its deadline."""

from __future__ import annotations

import pytest
import torch

from common.kv_transfer.config import TransferConfig
from common.kv_transfer.endpoint import KVEndpoint
from kvt_fixtures import FAST, LAYOUT, no_thread_leak  # noqa: F401
from test_kvt_engine import wait_finished


def test_each_role_builds_only_its_half(no_thread_leak):
    with KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST), role="prefill") as p, \
            KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST), role="decode") as d:
        assert p.producer.table is not None and d.consumer.table is not None
        with pytest.raises(AttributeError, match="prefill node's KV endpoint has no consumer half"):
            p.consumer  # noqa: B018
        with pytest.raises(AttributeError, match="decode node's KV endpoint has no producer half"):
            d.producer  # noqa: B018
        assert p.pair_counts() == {} and d.pair_counts() == {}
    with pytest.raises(ValueError, match="role must be one of prefill, decode, both"):
        KVEndpoint("127.0.0.1:0", LAYOUT, role="colocated")


def test_asking_a_decode_endpoint_for_kv_fails_at_once_naming_it(no_thread_leak):
    """A decode node named where a prefill node should be (a forged or mistyped id): the handshake
    is refused by the endpoint, well before the consumer's handshake deadline."""
    slow = TransferConfig(**dict(FAST, handshake_timeout_s=30.0, timeout_s=30.0))
    with KVEndpoint("127.0.0.1:0", LAYOUT, slow, role="decode") as wrong, \
            KVEndpoint("127.0.0.1:0", LAYOUT, slow, role="decode") as d:
        kv = [torch.zeros(LAYOUT.layer_shape(8), dtype=LAYOUT.torch_dtype) for _ in range(LAYOUT.num_layers)]
        d.consumer.request("r", wrong.address, [0, 1], 8, kv)
        done, failed = wait_finished(d, {"r"}, timeout=10.0)
        assert done == {} and "decode node's: it has no KV to give" in failed["r"]


def test_closing_a_producer_does_not_wait_for_a_pair_nobody_joined(no_thread_leak):
    """A handshake whose consumer never connects leaves a sender waiting for it (up to the connect
    timeout, 60 s here): closing the endpoint stops that wait at once, so a daemon's shutdown is
    not held up by whoever reached its KV port."""
    from common.kv_transfer.messages import Handshake, HandshakeOk, decode, encode
    from common.kv_transfer.transport import Endpoint
    from helpers.zmq_peer import raw_dealer

    slow = TransferConfig(**dict(FAST, connect_timeout_s=60.0))
    p = KVEndpoint("127.0.0.1:0", LAYOUT, slow, role="prefill")
    try:
        with raw_dealer(p.address) as stranger:
            stranger.send(encode(Handshake(id=1, pair_id="never-joined", layout=LAYOUT.to_dict(), backend="tcp",
                                           endpoint=Endpoint.local("cpu").to_dict())))
            assert stranger.poll(10_000) and isinstance(decode(stranger.recv()), HandshakeOk)
        [link] = list(p.producer._links.values())
        assert link.builder is not None and link.builder.is_alive()  # waiting for its consumer
    finally:
        p.close()
    assert not link.builder.is_alive()
