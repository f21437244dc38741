"""The decode daemon: KV in from the prefill daemon, tokens streamed out.

A request's life here, as queues (SGLang's picture):

1. **arrive** — the proxy POSTs the client's body with a tagged ``X-Request-Id``; the
   daemon tokenizes it exactly as the prefill daemon does (same model, same template).
   Untagged requests get a 400, unless they carry ``kv_transfer_params`` from a prefill node's
   answer with ``do_remote_prefill`` (vLLM's NIXL proxy, llm-d): once checked, they give the
   transfer id and prefill node to run under, as a tag would (common.serving.kv_params).
   The id is used exactly as received.
2. **prealloc** — the scheduler allocates blocks for the whole prompt and parks the
   request: it holds blocks but no running slot, so other requests keep decoding.
3. **transfer** — the consumer connector asks the prefill daemon named in the id for
   the KV (block ids, token count, a nonce over ZMQ; the layout was checked when the pair
   was built); each layer lands straight in the parked request's blocks over the pair's
   data plane (tcp on CPU, cuda_ipc between GPUs of one host, nccl across hosts, gloo on
   request), and DONE is checked (nonce, layers, bytes) before the request runs.
4. **running** — DONE carries the prefill daemon's first token: it is appended and
   streamed, and decoding goes on from there (the last prompt token is not recomputed).
5. **failure** — a dead or unreachable prefill daemon or a timeout
   (``--kv-timeout-s``) ends the request with an error and frees its blocks; a client
   that disconnects mid-transfer aborts it (blocks held until the receive has stopped).
   A request refused here (a 4xx: bad input, prompt too long) never asks for its KV, so
   the prefill node is told to drop it at once instead of holding it until its lease ends
   (decode_node.release).
6. **override** — a prompt this node has all but one stall-bounded step of cached is computed
   here instead of pulled, and the prefill node is told to drop its KV (decode_node.connector).
7. **fallback** — a prefill node that refuses a pair (all its ``--kv-max-pairs`` slots taken)
   costs the request no error: its prompt is computed here, as a local prefill, counted in
   ``pdserve:decode_prefill_overrides_total{reason}`` (decode_node.connector).
"""

from __future__ import annotations

import collections

from fastapi import FastAPI
from prometheus_client import Counter

from common.config import NodeConfig
from common.metrics import PREFIX, NodeMetrics
from common.node.daemon import Daemon
from common.node.daemon_roles import serve_daemon
from decode_node.connector import ConsumerConnector
from decode_node.release import ReleaseRefusedKV


def serve(config: NodeConfig) -> None:
    """``python -m decode_node``: a decode daemon until SIGTERM / SIGINT. It carries no other role
    (roles import no other role); ``pdserve decode`` (pdserve/daemon.py) can flip to prefill."""
    serve_daemon(config, {"decode": DecodeRole()})


class DecodeRole:
    """What the decode role adds to a daemon (common.node.daemon_roles.DaemonRole); its override
    counts run on across the node's flips."""

    def __init__(self) -> None:
        self.overrides: collections.Counter[str] = collections.Counter()

    def connector(self) -> ConsumerConnector:
        return ConsumerConnector(self.overrides)

    def prepare(self, daemon: Daemon) -> None:
        return None

    def install(self, app: FastAPI, daemon: Daemon) -> None:
        add_release_on_refusal(app, daemon)
        add_override_counter(daemon.metrics, self.overrides)


def add_release_on_refusal(app: FastAPI, daemon: Daemon) -> None:
    def release(request_id: str, prefill_addr: str) -> None:
        if daemon.config.role != "decode" or daemon.transfer is None:
            return  # a node flipped to prefill pulled nothing: there is no KV to drop
        # keyless, the id is unverified and may name any address: a connection is opened only to a
        # prefill node --kv-peers or the registry named; to any other, only one already open is used
        connect = daemon.key is not None or daemon.vouched_prefill(prefill_addr)
        daemon.transfer.consumer.release_remote(request_id, prefill_addr, connect=connect)

    app.add_middleware(ReleaseRefusedKV, release=release)


def add_override_counter(metrics: NodeMetrics, overrides: collections.Counter[str]) -> None:
    """``pdserve:decode_prefill_overrides_total{role, reason}``: requests tagged for a remote
    prefill that this node computed itself (see decode_node.connector), brought up to date at scrape."""
    counter = Counter(PREFIX + "decode_prefill_overrides", "Requests tagged for a remote prefill that the "
                      "decode node prefilled itself, by reason (cached: mostly cached here; pairs_full: the "
                      "prefill node was at --kv-max-pairs; pair_refused: it refused the pair otherwise)",
                      ["role", "reason"], registry=metrics.registry)
    for reason in ("cached", "pairs_full", "pair_refused"):  # shown at 0 before the first one
        counter.labels(metrics.role, reason)
    exported: dict[str, int] = {}

    def export() -> None:
        for reason, total in list(overrides.items()):
            if total > exported.get(reason, 0):
                counter.labels(metrics.role, reason).inc(total - exported.get(reason, 0))
                exported[reason] = total

    metrics.add_scrape_hook(export)
