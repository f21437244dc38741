"""The same transfers over NCCL: producer on cuda:0, consumer on cuda:1 (needs 2 GPUs)."""

from __future__ import annotations

import pytest
import torch

from kvt_fixtures import FAST, LAYOUT
from kvt_peers import make_kv, peer, same_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


@pytest.mark.parametrize("consumer_first", [True, False])
def test_nccl_transfer_exact_bytes(consumer_first):
    cfg = dict(FAST, timeout_s=20.0, handshake_timeout_s=60.0)
    with peer(LAYOUT, cfg, device="cuda:0") as p, peer(LAYOUT, cfg, device="cuda:1") as d:
        d_ids, p_ids = [3, 1, 8], [0, 5, 2]
        if consumer_first:
            d.call("request", "g", p.address, d_ids, 10, 16)
        p.call("prefill", "g", 7, 16, p_ids, 10, 77, True, 0.0, timeout=120)
        if not consumer_first:
            d.call("request", "g", p.address, d_ids, 10, 16)
        assert d.call("poll", 60, ["g"], timeout=90) == ({"g": 77}, {})
        got = d.call("fetch", "g")
        want = make_kv(LAYOUT, 16, 7)
        assert all(same_bytes(got[i][:, d_ids], want[i][:, p_ids]) for i in range(LAYOUT.num_layers))
        assert p.call("freeable", 10, ["g"]) == ["g"]
        p.stop()
        d.stop()
