"""Choosing a pair's data plane at the handshake: the rule itself, and across processes."""

from __future__ import annotations

import pytest
import torch

from common.kv_transfer.config import TransferConfig
from common.kv_transfer.endpoint import KVEndpoint
from common.kv_transfer.transport import Endpoint, TransportMismatchError, choose_transport, ipc_fallback
from kvt_fixtures import FAST, LAYOUT, no_thread_leak  # noqa: F401
from kvt_peers import peer
from test_kvt_engine import P_BLOCKS, assert_landed, d_cache, wait_finished

CPU_A, CPU_B = Endpoint("a", "cpu"), Endpoint("b", "cpu")
GPU0, GPU1 = Endpoint("a", "cuda", "GPU-0"), Endpoint("a", "cuda", "GPU-1")
GPU_OTHER_HOST = Endpoint("b", "cuda", "GPU-9")


@pytest.mark.parametrize("p, d, want", [
    (CPU_A, CPU_B, "tcp"),  # CPU: the plain-socket plane
    (CPU_A, CPU_A, "tcp"),
    (GPU0, GPU0, "cuda_ipc"),  # one shared GPU: the only pair that works there
    (GPU0, GPU1, "cuda_ipc"),  # two GPUs in one host: a device-to-device copy
    (GPU0, GPU_OTHER_HOST, "nccl"),
])
def test_auto_picks_by_device_and_host(p, d, want):
    assert choose_transport("auto", p, "auto", d) == want


# Two containers on one machine: different hostnames (so different host ids), one physical GPU.
CTR_A = Endpoint("ctr-a/boot-1", "cuda", "GPU-5", "00000000:3B:00.0")
CTR_B = Endpoint("ctr-b/boot-1", "cuda", "GPU-5", "00000000:3B:00.0")
CTR_B_OWN_GPU = Endpoint("ctr-b/boot-1", "cuda", "GPU-6", "00000000:86:00.0")


@pytest.mark.parametrize("p, d, want", [
    (CTR_A, CTR_B, "cuda_ipc"),  # one GPU, whatever the hostnames: NCCL would say "Duplicate GPU detected"
    (GPU0, GPU1, "cuda_ipc"),  # two GPUs, one OS instance: they can share memory
    (CTR_A, CTR_B_OWN_GPU, "nccl"),  # two GPUs, two host ids: sharing memory is not known to work
    (GPU0, GPU_OTHER_HOST, "nccl"),  # two hosts
])
def test_auto_compares_the_physical_gpu_not_the_host_name(p, d, want):
    assert choose_transport("auto", p, "auto", d) == want
    assert choose_transport("auto", d, "auto", p) == want


def test_one_gpu_in_two_containers_refuses_nccl_naming_the_gpu_and_takes_cuda_ipc():
    with pytest.raises(TransportMismatchError) as err:
        choose_transport("nccl", CTR_A, "auto", CTR_B)
    assert "GPU-5 (00000000:3B:00.0)" in str(err.value) and "--kv-transport cuda_ipc" in str(err.value)
    assert choose_transport("cuda_ipc", CTR_A, "auto", CTR_B) == "cuda_ipc"
    assert ipc_fallback("auto", CTR_A, "auto", CTR_B) is None  # cannot map it: refuse, NCCL cannot work


def test_cuda_ipc_between_two_gpus_under_two_host_ids_refused_naming_nccl():
    with pytest.raises(TransportMismatchError, match="use nccl or auto"):
        choose_transport("cuda_ipc", CTR_A, "auto", CTR_B_OWN_GPU)


def test_endpoint_carries_the_pci_bus_id_and_reads_a_peer_without_it():
    assert Endpoint.from_dict(CTR_A.to_dict()) == CTR_A
    old = {"host": "h", "device_type": "cuda", "gpu_uuid": "GPU-5"}  # a peer from before the bus id
    assert Endpoint.from_dict(old) == Endpoint("h", "cuda", "GPU-5", "")
    assert Endpoint.local("cpu").pci_bus_id == ""


@pytest.mark.parametrize("p_mode, d_mode, want", [
    ("gloo", "auto", "gloo"), ("auto", "gloo", "gloo"), ("tcp", "tcp", "tcp"),
])
def test_one_explicit_side_decides(p_mode, d_mode, want):
    assert choose_transport(p_mode, CPU_A, d_mode, CPU_B) == want


@pytest.mark.parametrize("p_mode, p, d_mode, d, words", [
    ("gloo", CPU_A, "tcp", CPU_B, ["prefill has --kv-transport gloo", "decode has tcp"]),
    ("auto", CPU_A, "auto", GPU0, ["different device kinds", "prefill cpu, decode cuda"]),
    ("nccl", GPU0, "auto", GPU0, ["NCCL cannot pair two ranks on one GPU", "--kv-transport cuda_ipc"]),
    ("auto", GPU0, "cuda_ipc", GPU_OTHER_HOST, ["needs prefill and decode on one host", "use nccl"]),
    ("cuda_ipc", CPU_A, "auto", CPU_B, ["needs the KV caches on CUDA", "use tcp"]),
    ("auto", GPU0, "tcp", GPU1, ["moves CPU tensors", "cuda_ipc"]),
])
def test_impossible_pairs_refused_naming_the_fix(p_mode, p, d_mode, d, words):
    with pytest.raises(TransportMismatchError) as err:
        choose_transport(p_mode, p, d_mode, d)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("p_mode, p, d_mode, d, want", [
    ("auto", GPU0, "auto", GPU1, "nccl"),  # two GPUs, the other one not visible here: NCCL works
    ("auto", GPU0, "auto", GPU0, None),  # one GPU: NCCL cannot, refuse with the fix
    ("cuda_ipc", GPU0, "auto", GPU1, None),  # asked for by name: refuse, do not switch
    ("auto", GPU0, "cuda_ipc", GPU1, None),
])
def test_auto_falls_back_to_nccl_only_between_two_gpus(p_mode, p, d_mode, d, want):
    assert ipc_fallback(p_mode, p, d_mode, d) == want


def test_unknown_mode_refused():
    with pytest.raises(ValueError, match="--kv-transport must be one of"):
        choose_transport("rdma", CPU_A, "auto", CPU_B)
    with pytest.raises(ValueError, match="--kv-transport must be one of"):
        KVEndpoint("127.0.0.1:0", LAYOUT, transport="rdma")


@pytest.mark.parametrize("p_mode, d_mode, want", [("auto", "auto", "tcp"), ("gloo", "auto", "gloo")])
def test_pair_uses_the_negotiated_transport_across_processes(p_mode, d_mode, want, no_thread_leak):
    """Scattered blocks on both sides, the producer finishing while the consumer asks."""
    with peer(LAYOUT, FAST, transport=p_mode) as p, \
            KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST), transport=d_mode) as d:
        kv = d_cache()
        d_ids, p_ids = [7, 3, 30, 31, 5], [9, 1, 20, 21, 17]
        d.consumer.request("t", p.address, d_ids, 18, kv)
        p.call("prefill", "t", 4, P_BLOCKS, p_ids, 18, 55, True, 0.0)
        assert wait_finished(d, {"t"}) == ({"t": 55}, {})
        assert_landed(kv, d_ids, 4, p_ids, 18)
        assert d.pair_counts() == {want: 1} and p.call("pairs") == {want: 1}
        p.stop()


def test_explicit_mismatch_fails_the_request_at_the_handshake(no_thread_leak):
    with peer(LAYOUT, FAST, transport="gloo") as p, \
            KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST), transport="tcp") as d:
        kv = d_cache()
        d.consumer.request("x", p.address, [0, 1], 8, kv)
        done, failed = wait_finished(d, {"x"})
        assert done == {} and "prefill has --kv-transport gloo, decode has tcp" in failed["x"]
        assert d.pair_counts() == {} and p.call("pairs") == {}
        assert torch.count_nonzero(kv[0]) == 0
        p.stop()
