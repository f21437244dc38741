"""Strangers cannot take the KV pairs members need (issue 33, item 2), against real processes.

A keyless prefill node with ``--kv-max-pairs 2`` behind a proxy (``--disagg-policy always``):

1. Two stranger handshakes that name no registered decode node take both slots. An honest
   request still goes through a pair (its decode node is a member: a stranger's pair is dropped
   for it), and a stranger's slot ends at the short grace: a third stranger gets one then.
2. Strangers that name the registered decode node's own address (on one host, keyless, nothing
   tells them from it) hold every slot: the honest request's pair is refused, and the decode node
   computes the prompt itself: 200 with the same text, counted as
   ``pdserve:decode_prefill_overrides_total{reason="pairs_full"}``, never a 502.

The strangers handshake over the control plane and never join their pairs.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from common.kv_transfer.messages import Error, Handshake, HandshakeOk, decode, encode
from common.kv_transfer.transport import Endpoint
from common.model.config import ModelConfig
from common.model.embedded import ensure_embedded_model
from helpers.cluster import all_ready, start, stop_all
from helpers.waiting import wait_for
from helpers.zmq_peer import raw_dealer

PROMPT = list(range(40, 72))  # 32 tokens: two blocks
OTHER = list(range(100, 132))  # shares no block with PROMPT: not a cached-prefix override


@pytest.fixture(scope="module")
def layout():
    return ModelConfig.from_dir(ensure_embedded_model(Path("~/.cache/pdserve/models").expanduser())).kv_layout(
        16, "float32")


class Stranger:
    """Handshakes with a prefill node's KV control port, naming whatever consumer it likes."""

    def __init__(self, dealer, layout) -> None:
        self.dealer, self.layout, self.next_id = dealer, layout, 1

    def handshake(self, consumer: str) -> bool:
        """True when the prefill node gave the pair a slot (HandshakeOk), False when it refused it."""
        self.next_id += 1
        hello = Handshake(id=self.next_id, pair_id=uuid.uuid4().hex, layout=self.layout.to_dict(), backend="tcp",
                          endpoint=Endpoint.local("cpu").to_dict(), consumer=consumer)
        self.dealer.send(encode(hello))
        assert self.dealer.poll(10_000), "no handshake reply"
        reply = decode(self.dealer.recv())
        assert isinstance(reply, HandshakeOk | Error), reply
        if isinstance(reply, Error):
            assert "--kv-max-pairs" in reply.reason, reply.reason
        return isinstance(reply, HandshakeOk)


def _series(url: str, name: str, **labels: str) -> float:
    """The value of ``name``'s series with exactly these labels, from one scrape of ``/metrics``."""
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        head, _, value = line.rpartition(" ")
        series, _, rest = head.partition("{")
        found = dict(pair.split("=", 1) for pair in rest.rstrip("}").split(",") if pair)
        if series == name and {k: v.strip('"') for k, v in found.items()} == labels:
            return float(value)
    raise KeyError(f"{name}{labels} not in /metrics of {url}")


def _fallbacks(decode_node) -> float:
    return _series(decode_node.url, "pdserve:decode_prefill_overrides_total", role="decode", reason="pairs_full")


def _pairs(prefill) -> float:
    return _series(prefill.url, "pdserve:kv_pairs", role="prefill", transport="tcp")


def _members_told(prefill, decode_node) -> bool:
    """The registry has named the decode node to the prefill node as a member (its log says so)."""
    lines = prefill.log.read_text(errors="replace").splitlines()
    told = [line for line in lines if "peer KV address" in line]
    return bool(told) and decode_node.kv_addr in told[-1]


def _complete(proxy, prompt: list[int] = PROMPT) -> httpx.Response:
    body = {"model": "pdserve-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    return httpx.post(proxy.url + "/v1/completions", json=body, timeout=120)


def test_strangers_holding_every_pair_slot_cannot_fail_honest_requests(tmp_path, layout):
    proxy = start("proxy", tmp_path, "--disagg-policy", "always", wait=False)
    # beats every 0.5 s: a node learns the registry's members from the answer to its own beat
    registry = ("--proxy", f"127.0.0.1:{proxy.kv_port}", "--heartbeat-interval-s", "0.5")
    procs = {"proxy": proxy,
             "prefill": start("prefill", tmp_path, *registry, "--kv-max-pairs", "2", wait=False),
             "decode": start("decode", tmp_path, *registry, wait=False)}
    with all_ready(procs):
        prefill, decode_node = procs["prefill"], procs["decode"]
        assert wait_for(lambda: _members_told(prefill, decode_node), 30), prefill.log_tail()
        with raw_dealer(prefill.kv_addr) as dealer:
            stranger = Stranger(dealer, layout)
            # 1. strangers naming nobody hold both slots; a third is refused
            assert stranger.handshake("") and stranger.handshake("127.0.0.1:9")
            assert not stranger.handshake("")
            first = _complete(proxy)
            assert first.status_code == 200, first.text
            assert _fallbacks(decode_node) == 0  # the member's pair took a stranger's slot
            # the other stranger's slot ends at the grace (5 s): a new stranger gets it then
            assert wait_for(lambda: stranger.handshake(""), 30, step=0.25)

            # 2. a new decode node, whose address strangers name before it asks for a pair
            procs["decode"].stop()
            assert wait_for(lambda: _pairs(prefill) <= 1, 30)  # its pair went with it; a stranger's is left
            second = procs["decode2"] = start("decode", tmp_path, *registry, name="decode2")
            assert wait_for(lambda: _members_told(prefill, second), 30), prefill.log_tail()
            taken = [stranger.handshake(second.kv_addr) for _ in range(3)]  # a member's name: no probation
            assert taken[:2] == [True, True] and not taken[2]
            answers = [_complete(proxy, prompt) for prompt in (PROMPT, OTHER)]
            assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
            assert answers[0].json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
            assert _fallbacks(second) == 2  # computed on the decode node, counted by reason
    stop_all(procs.values())
