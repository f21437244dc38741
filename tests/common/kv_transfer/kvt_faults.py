"""Faults a producer child injects into what its tcp pair puts on the wire (``kvt_peers``'s
"fault" command): the consumer in the test process must catch each before it uses the KV.

``truncate``: the first KV message carries one block fewer than the request's (header and
bytes agree, so the stream stays in step: a partial layer). ``flip``: one byte of the first
KV message differs on the wire from the blocks the checksum was taken over. ``ghost``: a DONE
for a request the consumer never asked for follows each KV message. ``stale``: DONE echoes
another transfer's nonce. ``replay``: the first request's layers and DONE are sent again in
front of every later request's (a transfer landing after its blocks were freed and reused).
"""

from __future__ import annotations

import torch

from common.kv_transfer.messages import Done, encode
from common.kv_transfer.sender import PairSender
from common.kv_transfer.tcp_pair import TcpPair


def install(kind: str) -> None:
    if kind in ("truncate", "flip"):
        _corrupt_first_message(kind)
    elif kind == "ghost":
        original = PairSender._send_tcp

        def send_tcp(self, job, ahead):
            original(self, job, ahead)
            self.pair.send_message(encode(Done(request_id="ghost", pair_id=self.pair_id, first_token=1)))
        PairSender._send_tcp = send_tcp
    elif kind == "stale":
        original_done = PairSender._done

        def done(self, req):
            msg = original_done(self, req)
            msg.nonce ^= 2
            return msg
        PairSender._done = done
    elif kind == "replay":
        _replay_first_request()
    else:
        raise ValueError(kind)


def _corrupt_first_message(kind: str) -> None:
    original = TcpPair.send_kv
    state = {"done": False}

    def send_kv(self, request_id, kv_caches, layers, block_ids, trailer=b""):
        if state["done"]:
            return original(self, request_id, kv_caches, layers, block_ids, trailer)
        state["done"] = True
        if kind == "truncate":
            return original(self, request_id, kv_caches, layers, block_ids[:-1], trailer)
        copies = {x: kv_caches[x].clone() for x in layers}  # the blocks themselves stay intact
        copies[layers[0]][1, block_ids[-1]].reshape(-1).view(torch.uint8)[3] ^= 0x10  # a value's byte
        return original(self, request_id, copies, layers, block_ids, trailer)
    TcpPair.send_kv = send_kv


def _replay_first_request() -> None:
    original = PairSender._send_tcp
    first: list = []  # [(request id, kv copies, layers, block ids, DONE frame)]

    def send_tcp(self, job, ahead):
        kv_caches, ids = self._source(job)
        if first and first[0][0] != job.req.request_id:
            rid, kv, layers, old_ids, done = first[0]
            self.pair.send_kv(rid, kv, layers, old_ids, done)
        original(self, job, ahead)
        if not first and ahead is not None and ahead.kind == "done" and ahead.req is job.req:
            kv = {x: kv_caches[x].clone() for x in job.layers}
            done = self.pair.message_frame(encode(self._done(job.req)))
            first.append((job.req.request_id, kv, list(job.layers), list(ids), done))
    PairSender._send_tcp = send_tcp
