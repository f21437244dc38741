"""Keyless is loopback only (issue 33, item 1): a daemon or proxy without a cluster key refuses to
listen on any other address unless ``--insecure-keyless-network`` is given, and the keyless
registry takes a node's registration (or goodbye) only for the host its connection comes from.

The refusals bind nothing and send nothing: the processes exit at their start-up checks. The
registry test stays on loopback and names a documentation address (TEST-NET-3) it never contacts.
"""

from __future__ import annotations

import subprocess
import sys

import msgpack
import pytest
from helpers import zygote
from helpers.cluster import ROOT, start, stop_all
from helpers.ports import free_port
from helpers.waiting import wait_for
from helpers.zmq_peer import raw_dealer

from common.config import routable_host
from common.node.startup import START_FAILED_EXIT_CODE
from proxy.registry import ServiceRegistry

ADDRESS = routable_host()
needs_address = pytest.mark.skipif(ADDRESS is None, reason="this host has no address but loopback to refuse")


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    return zygote.run([sys.executable, "-m", module, *args], timeout=120, cwd=ROOT,
                      env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})


@needs_address
@pytest.mark.parametrize("module, args", [
    ("decode_node", ["--host", "{a}"]),
    ("prefill_node", ["--host", "0.0.0.0", "--kv-host", "{a}"]),
    ("prefill_node", ["--kv-host", "{a}"]),  # HTTP on loopback, but the pairs would listen on {a}
    ("proxy", ["--registry-host", "{a}"]),
    ("proxy", ["--host", "{a}"]),
])
def test_a_keyless_process_refuses_a_non_loopback_address(module: str, args: list[str]) -> None:
    argv = [a.format(a=ADDRESS) for a in args] + ["--port", str(free_port())]
    refused = _run(module, *argv)
    assert refused.returncode == START_FAILED_EXIT_CODE, refused.stderr
    assert refused.stderr.count("\n") == 1, refused.stderr  # one line, no traceback
    assert "not loopback and no --cluster-key-file is set" in refused.stderr
    assert "--insecure-keyless-network" in refused.stderr and ADDRESS in refused.stderr


@needs_address
def test_insecure_keyless_network_lets_a_daemon_start_there(tmp_path) -> None:
    """The flag is the deliberate way out: the daemon starts on that address (and warns)."""
    node = start("decode", tmp_path, "--host", ADDRESS, "--insecure-keyless-network", wait=False)
    try:
        assert wait_for(lambda: "without a cluster key" in node.log.read_text(errors="replace")
                        or node.popen.poll() is not None, 120), node.log_tail()
        assert node.popen.poll() is None, node.log_tail()
    finally:
        stop_all([node])


def test_the_colocated_node_and_loopback_need_no_key() -> None:
    """``pdserve serve`` has no peers, so 0.0.0.0 stays allowed; a keyless daemon on loopback
    passes its checks (only the flags are parsed here: --help never starts anything)."""
    from common.config import NodeConfig, load_config
    from common.node.node import check_ports

    serve = load_config(NodeConfig, ["--host", "0.0.0.0", "--port", str(free_port())], "pdserve serve", env={})
    check_ports(serve)
    decode = load_config(NodeConfig, ["--port", str(free_port()), "--kv-port", str(free_port())],
                         "pdserve decode", fixed={"role": "decode"}, env={})
    check_ports(decode)


def _beat(node_type: str, http: str, kv: str, **extra) -> bytes:
    return msgpack.packb({"type": node_type, "http_address": http, "zmq_address": kv, "model": "m",
                          "kv_fingerprint": "f", **extra})


def test_keyless_registry_takes_only_the_senders_own_address() -> None:
    """From 127.0.0.1, a node at 203.0.113.7 (or at a name) is refused and counted, and so is a
    goodbye for a node there; the same node at 127.0.0.1 registers."""
    registry = ServiceRegistry(port=0, heartbeat_timeout_s=60)
    registry.start()
    try:
        with raw_dealer(registry.address) as stranger:
            stranger.send(_beat("D", "203.0.113.7:8200", "203.0.113.7:14580"))
            stranger.send(_beat("P", "127.0.0.1:8100", "203.0.113.7:14579"))  # one of the two is enough
            stranger.send(_beat("D", "decode-0.example:8200", "decode-0.example:14580"))
            stranger.send(_beat("D", "203.0.113.7:8200", "203.0.113.7:14580", goodbye=True))
            assert wait_for(lambda: registry.rejected().get("address_not_source", 0) == 4)
            assert registry.counts() == {"P": 0, "D": 0}
            stranger.send(_beat("P", "127.0.0.1:8100", "127.0.0.1:14579"))
            stranger.send(_beat("D", "localhost:8200", "127.0.0.1:14580"))
            assert wait_for(lambda: registry.counts() == {"P": 1, "D": 1})
        assert sorted(n.info.zmq_address for n in registry.nodes()) == ["127.0.0.1:14579", "127.0.0.1:14580"]
    finally:
        registry.stop()
