"""Faults a producer child injects into what its tcp pair puts on the wire (``kvt_peers``'s
"fault" command): the consumer in the test process must catch each before it uses the KV.

``truncate``: the first KV message carries one block fewer than the request's (header and
bytes agree, so the stream stays in step: a partial layer). ``flip``: one byte of the first
KV message differs on the wire from the blocks the checksum was taken over. ``ghost``: a DONE
for a request the consumer never asked for follows each KV message. ``stale``: DONE echoes
another transfer's nonce. ``replay``: the first request's layers and DONE are sent again in
front of each later request's first message (a transfer landing after its blocks were freed and reused).
"""

from __future__ import annotations

import torch

from common.kv_transfer.messages import Done, encode
import common.kv_transfer.sender as sender_mod
from common.kv_transfer.sender import PairSender
from common.kv_transfer.tcp_pair import TcpPair


def install(kind: str) -> None:
    if kind in ("truncate", "flip"):
        _corrupt_first_message(kind)
    elif kind == "ghost":  # behind each KV message (and its DONE), on the same stream
        original, original_send = sender_mod.kv_message, PairSender._send_tcp
        sending = {"pair_id": ""}

        def send_tcp(self, job, ahead):
            sending["pair_id"] = self.pair_id
            original_send(self, job, ahead)

        def kv_message(request_id, kv_caches, layers, block_ids, trailer=b""):
            ghost = Done(request_id="ghost", pair_id=sending["pair_id"], first_token=1)
            return original(request_id, kv_caches, layers, block_ids, trailer + TcpPair.message_frame(encode(ghost)))
        PairSender._send_tcp = send_tcp
        sender_mod.kv_message = kv_message
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
    original = sender_mod.kv_message
    state = {"done": False}

    def kv_message(request_id, kv_caches, layers, block_ids, trailer=b""):
        if state["done"]:
            return original(request_id, kv_caches, layers, block_ids, trailer)
        state["done"] = True
        if kind == "truncate":
            return original(request_id, kv_caches, layers, block_ids[:-1], trailer)
        copies = {x: kv_caches[x].clone() for x in layers}  # the blocks themselves stay intact
        copies[layers[0]][1, block_ids[-1]].reshape(-1).view(torch.uint8)[3] ^= 0x10  # a value's byte
        return original(request_id, copies, layers, block_ids, trailer)
    sender_mod.kv_message = kv_message


def _replay_first_request() -> None:
    """Record the first request's layer messages and its DONE as they are sent, however they
    are grouped (one job or several, DONE riding with the last layer or alone), and put them on
    the wire again in front of each later request's first message."""
    original_send, original_done = PairSender._send_tcp, PairSender._done
    first: dict = {"rid": None, "sent": [], "done": None}  # sent: [(kv copies, layers, block ids)]
    replayed: set[str] = set()

    def done(self, req):
        msg = original_done(self, req)
        if req.request_id == first["rid"] and first["done"] is None:
            first["done"] = self.pair.message_frame(encode(msg))
        return msg

    def send_tcp(self, job, ahead):
        rid = job.req.request_id
        first["rid"] = first["rid"] or rid
        if rid == first["rid"] and first["done"] is None:
            kv_caches, ids = self._source(job)
            first["sent"].append(({x: kv_caches[x].clone() for x in job.layers}, list(job.layers), list(ids)))
        elif rid != first["rid"] and rid not in replayed and first["done"] is not None:
            replayed.add(rid)
            for i, (kv, layers, ids) in enumerate(first["sent"]):
                self.pair.send_kv(first["rid"], kv, layers, ids, first["done"] if i == len(first["sent"]) - 1 else b"")
        original_send(self, job, ahead)
    PairSender._send_tcp = send_tcp
    PairSender._done = done
