"""The prefill daemon: prompts in, KV pushed layer by layer to the decode daemon.

A request's life here:

1. **arrive** — the proxy POSTs the client's body with ``max_tokens`` 1 and a tagged
   ``X-Request-Id`` (``___prefill_addr_…___decode_addr_…``). Untagged requests get a 400,
   unless they carry ``kv_transfer_params`` with ``do_remote_decode`` (vLLM's NIXL proxy, llm-d):
   then this node makes the id itself, naming any decode node, and its answer carries the params
   that say where the KV waits (common.serving.kv_params); from here on the two paths are one.
   The id is used exactly as received: the decode daemon asks for the KV by it.
2. **prefill** — the engine schedules it like any request (chunked when long). After
   each layer of the pass that completes the prompt, the producer connector offers that
   layer to the KV endpoint: pushed now if the decode daemon already asked, else
   left in the paged blocks.
3. **hand-over** — the first token is sampled; the KV endpoint gets the request
   (lease starts) and sends the rest of the KV plus the first token as soon as the
   decode daemon asks. The HTTP answer (that one token) goes back to the proxy.
4. **release** — the blocks stay held until the decode daemon acknowledges, aborts,
   the transfer fails, or the lease (``--kv-lease-s``) expires; then they are freed.

KV held for requests no decode daemon has asked for yet is capped at
``--max-unclaimed-kv-share`` of the cache: past it a new prefill leg gets a 503 (the
proxy tries another prefill node), so ids that nobody will ever pull cannot pin the cache.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from common.config import NodeConfig
from common.node.daemon import Daemon
from common.node.daemon_roles import serve_daemon
from common.serving.context import PreparedRequest
from common.serving.errors import OpenAIError
from prefill_node.connector import ProducerConnector


def serve(config: NodeConfig) -> None:
    """``python -m prefill_node``: a prefill daemon until SIGTERM / SIGINT. It carries no other role
    (roles import no other role); ``pdserve prefill`` (pdserve/daemon.py) can flip to decode."""
    serve_daemon(config, {"prefill": PrefillRole(config)})


class PrefillRole:
    """What the prefill role adds to a daemon (common.node.daemon_roles.DaemonRole)."""

    def __init__(self, config: NodeConfig) -> None:
        self.max_unclaimed_share = config.max_unclaimed_kv_share

    def connector(self) -> ProducerConnector:
        return ProducerConnector()

    def prepare(self, daemon: Daemon) -> PrefillAdmission:
        return PrefillAdmission(daemon, self.max_unclaimed_share)

    def install(self, app: FastAPI, daemon: Daemon) -> None:
        pass


class PrefillAdmission:
    """The prefill role's ``prepare_request``: one token, and room for KV nobody claimed yet."""

    def __init__(self, daemon: Daemon, max_unclaimed_share: float) -> None:
        assert daemon.transfer is not None
        self.daemon = daemon  # its KV endpoint's producer half is read at each request: a flip builds a new one
        self.block_size = daemon.transfer.layout.block_size
        total = daemon.engine.stats().num_total_blocks
        self.limit_blocks = max(1, int(total * max_unclaimed_share))

    def __call__(self, prepared: PreparedRequest, http_request: Request) -> None:
        prepared.params.max_tokens = 1  # a prefill leg produces exactly the first token
        # the decode node checks the client's min_tokens against its max_tokens; here only
        # "may the first token be a stop token" matters
        prepared.params.min_tokens = min(prepared.params.min_tokens, 1)
        prepared.params.stop = []  # the decode side applies stop strings to the whole text
        if prepared.tags is None:
            return
        prepared.admit = lambda: self._reserve(prepared)

    def _reserve(self, prepared: PreparedRequest) -> None:
        need = -(-len(prepared.prompts[0]) // self.block_size)
        assert self.daemon.transfer is not None
        if not self.daemon.transfer.producer.reserve_unclaimed(prepared.request_id, need, self.limit_blocks):
            raise OpenAIError(
                f"this prefill node already holds its limit of KV that no decode node has asked for "
                f"({self.limit_blocks} blocks, --max-unclaimed-kv-share); retry later or on another node",
                status=503, type="service_unavailable", code="unclaimed_kv_limit",
            )
