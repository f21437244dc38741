"""``KVEndpoint.switch_role`` (a daemon's role flip, common/node/role_flip.py): the endpoint closes
its half and builds the other on the same control plane, so its address stays and a peer asking the
wrong half is told so at once; a transfer through the new half works."""

from __future__ import annotations

import pytest

from common.kv_transfer.config import TransferConfig
from common.kv_transfer.endpoint import KVEndpoint
from kvt_fixtures import FAST, LAYOUT, no_thread_leak  # noqa: F401
from kvt_peers import peer
from test_kvt_engine import P_BLOCKS, assert_landed, d_cache, wait_finished


@pytest.mark.usefixtures("no_thread_leak")
def test_a_prefill_endpoint_becomes_decode_and_pulls_kv_then_back():
    with peer(LAYOUT, FAST) as p, KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST), role="prefill") as e:
        address = e.address
        e.switch_role("decode")
        assert (e.role, e.address) == ("decode", address)
        with pytest.raises(AttributeError, match="decode node's KV endpoint has no producer half"):
            e.producer  # noqa: B018
        kv = d_cache()
        d_ids, p_ids = [7, 3, 30], [9, 1, 20]
        e.consumer.request("r1", p.address, d_ids, 10, kv)
        assert p.call("wait_state", "r1", "pulled", 10) == "pulled"
        assert p.call("prefill", "r1", 11, P_BLOCKS, p_ids, 10, 1234, True, 0.0) == "ok"
        assert wait_finished(e, {"r1"}) == ({"r1": 1234}, {})
        assert_landed(kv, d_ids, 11, p_ids, 10)
        e.switch_role("prefill")
        assert (e.role, e.address) == ("prefill", address) and e.producer.table is not None
        with pytest.raises(AttributeError, match="prefill node's KV endpoint has no consumer half"):
            e.consumer  # noqa: B018
        p.stop()
    with KVEndpoint("127.0.0.1:0", LAYOUT, role="both") as both, pytest.raises(ValueError):
        both.switch_role("decode")


@pytest.mark.usefixtures("no_thread_leak")
def test_a_switch_that_failed_half_way_is_redone_even_to_the_same_role():
    """The old half closed, the new one never built: a later switch to the old role rebuilds it (a
    fenced node's retry, common/node/role_flip.py) instead of keeping the closed half."""
    with KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST), role="prefill") as e:
        closed = e.producer
        build = e._new_half
        e._new_half = lambda role: (_ for _ in ()).throw(RuntimeError("no memory for the pair buffers"))
        with pytest.raises(RuntimeError):
            e.switch_role("decode")
        e._new_half = build
        e.switch_role("prefill")
        assert e.role == "prefill" and e.producer is not closed
