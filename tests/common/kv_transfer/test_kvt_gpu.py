"""Transfers between CUDA caches: cuda_ipc on one GPU (where NCCL refuses two ranks) and
between two GPUs of one host (the copy ends on the destination GPU's stream), NCCL between
two GPUs (asked for explicitly: on one host auto picks cuda_ipc); a gone consumer's
mapping released."""

from __future__ import annotations

import pytest
import torch

from kvt_fixtures import FAST, LAYOUT
from kvt_peers import make_kv, peer, same_bytes

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs CUDA")]

CFG = dict(FAST, timeout_s=20.0, handshake_timeout_s=60.0, connect_timeout_s=60.0)
TWO_GPUS = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")


@pytest.mark.parametrize("consumer_first", [True, False])
@pytest.mark.parametrize("p_dev, d_dev, transport", [
    ("cuda:0", "cuda:0", "auto"),  # -> cuda_ipc
    pytest.param("cuda:0", "cuda:1", "auto", marks=TWO_GPUS),  # -> cuda_ipc across two GPUs
    pytest.param("cuda:0", "cuda:1", "nccl", marks=TWO_GPUS),
])
def test_exact_bytes_between_cuda_caches(p_dev, d_dev, transport, consumer_first):
    want_transport = "cuda_ipc" if transport == "auto" else transport
    with peer(LAYOUT, CFG, device=p_dev, transport=transport) as p, \
            peer(LAYOUT, CFG, device=d_dev, transport=transport) as d:
        d_ids, p_ids = [3, 1, 8, 9], [0, 5, 2, 3]  # scattered and partly contiguous
        d.call("request_shared", 16)  # one cache per consumer, as in a daemon (cuda_ipc maps it once)
        if consumer_first:
            d.call("request", "g", p.address, d_ids, 14, 16)
        p.call("prefill", "g", 7, 16, p_ids, 14, 77, True, 0.0, timeout=120)
        if not consumer_first:
            d.call("request", "g", p.address, d_ids, 14, 16)
        assert d.call("poll", 60, ["g"], timeout=90) == ({"g": 77}, {})
        got = d.call("fetch", "g")
        want = make_kv(LAYOUT, 16, 7)
        assert all(same_bytes(got[i][:, d_ids], want[i][:, p_ids]) for i in range(LAYOUT.num_layers))
        assert p.call("freeable", 10, ["g"]) == ["g"]
        assert d.call("pairs") == {want_transport: 1}
        p.stop()
        d.stop()


def test_nccl_on_one_gpu_refused_at_handshake_naming_cuda_ipc():
    with peer(LAYOUT, CFG, device="cuda:0", transport="nccl") as p, peer(LAYOUT, CFG, device="cuda:0") as d:
        d.call("request", "n", p.address, [0, 1], 8, 4)
        done, failed = d.call("poll", 60, ["n"], timeout=90)
        assert done == {} and "--kv-transport cuda_ipc" in failed["n"]
        assert d.call("pairs") == {}
        p.stop()
        d.stop()


def test_a_gone_consumers_cache_is_unmapped_and_its_memory_comes_back():
    """A decode daemon that dies (or restarts) says no goodbye; the prefill side drops its
    cuda_ipc pair once its pings stop, and with it the mapping that kept the dead daemon's
    whole KV cache allocated on the GPU."""
    cfg = dict(FAST, connect_timeout_s=60.0, handshake_timeout_s=60.0)  # silent after ~3 s
    big = 1 << 20  # blocks: 512 MiB a layer in this layout, 2 GiB in all
    with peer(LAYOUT, cfg, device="cuda:0") as p:
        base = p.call("gpu_free_bytes")
        with peer(LAYOUT, cfg, device="cuda:0") as d:
            d.call("request_shared", big)
            d.call("request", "m", p.address, [big - 1, 0], 8, big)
            p.call("prefill", "m", 3, 16, [4, 5], 8, 9, True, 0.0, timeout=120)
            assert d.call("poll", 60, ["m"], timeout=90) == ({"m": 9}, {})
            assert p.call("pairs") == {"cuda_ipc": 1}
            d.kill()  # no goodbye
        assert p.call("wait_pairs", {}, 60, timeout=90) == {}
        assert p.call("gpu_free_bytes") > base - (256 << 20), "the dead consumer's cache is still mapped"
        p.stop()
