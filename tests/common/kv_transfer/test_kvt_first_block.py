"""A consumer that already holds a prompt's first blocks (its prefix cache) asks only for the
rest: the producer sends blocks ``first_block..`` and nothing lands in the blocks before."""

from __future__ import annotations

import msgpack
import pytest
import torch

from common.kv_transfer.config import TransferConfig
from common.kv_transfer.endpoint import KVEndpoint
from common.kv_transfer.messages import PROTOCOL_VERSION, Pull, decode
from kvt_fixtures import FAST, LAYOUT, no_thread_leak  # noqa: F401
from kvt_peers import make_kv, peer, same_bytes
from test_kvt_engine import P_BLOCKS, d_cache, wait_finished


def test_pull_without_first_block_means_everything():
    old = {"v": PROTOCOL_VERSION, "cmd": "pull", "id": 1, "request_id": "r", "pair_id": "p",
           "num_blocks": 3, "num_tokens": 10, "block_ids": [4, 5, 6]}  # a peer from before the field
    assert decode(msgpack.packb(old)) == Pull(id=1, request_id="r", pair_id="p", num_blocks=3, num_tokens=10,
                                              block_ids=[4, 5, 6], first_block=0)


@pytest.mark.parametrize("pull_first", [True, False], ids=["pull-then-prefill", "prefill-then-pull"])
def test_only_the_blocks_after_first_block_move(pull_first, no_thread_leak):
    with peer(LAYOUT, FAST) as p, KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST)) as d:
        kv = d_cache()
        p_ids, d_ids = [9, 1, 20, 4, 17], [7, 3, 30, 12, 5]  # 18 tokens: 5 blocks of 4
        first = 3  # the consumer has the first 3 blocks already
        if pull_first:
            d.consumer.request("r", p.address, d_ids[first:], 18, kv, first_block=first)
            assert p.call("wait_state", "r", "pulled", 10) == "pulled"  # PULL reached P before prefill
        assert p.call("prefill", "r", 11, P_BLOCKS, p_ids, 18, 77, True, 0.02) == "ok"
        # which path ran: layers pushed as prefill computed them, or all sent from the blocks after
        assert p.call("eager", "r") == (LAYOUT.num_layers if pull_first else 0)
        if not pull_first:
            assert p.call("wait_state", "r", "held", 0) == "held"  # finished, nobody asked yet
            d.consumer.request("r", p.address, d_ids[first:], 18, kv, first_block=first)
        assert wait_finished(d, {"r"}) == ({"r": 77}, {})
        p_kv = make_kv(LAYOUT, P_BLOCKS, 11)
        for layer in range(LAYOUT.num_layers):
            assert same_bytes(kv[layer][:, d_ids[first:]], p_kv[layer][:, p_ids[first:]])
            assert torch.count_nonzero(kv[layer][:, d_ids[:first]]) == 0  # held blocks untouched
        assert d.stats.bytes_received == LAYOUT.num_layers * 2 * LAYOUT.bytes_per_block_per_layer()
        assert p.call("freeable", 5, ["r"]) == ["r"]
        p.stop()


def test_first_block_past_the_prompt_is_refused(no_thread_leak):
    with KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST)) as d:
        kv = d_cache()
        with pytest.raises(ValueError):
            d.consumer.request("r", "127.0.0.1:1", [1], 8, kv, first_block=2)
