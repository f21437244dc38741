"""The prefill daemon: prompts in, KV pushed layer by layer to the decode daemon.

A request's life here:

1. **arrive** — the proxy POSTs the client's body with ``max_tokens`` 1 and a tagged
   ``X-Request-Id`` (``___prefill_addr_…___decode_addr_…``). Untagged requests get a 400.
   The id is used exactly as received: the decode daemon asks for the KV by it.
2. **prefill** — the engine schedules it like any request (chunked when long). After
   each layer of the pass that completes the prompt, the producer connector offers that
   layer to the transfer engine: pushed now if the decode daemon already asked, else
   left in the paged blocks.
3. **hand-over** — the first token is sampled; the transfer engine gets the request
   (lease starts) and sends the rest of the KV plus the first token as soon as the
   decode daemon asks. The HTTP answer (that one token) goes back to the proxy.
4. **release** — the blocks stay held until the decode daemon acknowledges, aborts,
   the transfer fails, or the lease (``--kv-lease-s``) expires; then they are freed.
"""

from __future__ import annotations

from fastapi import Request

from common.config import NodeConfig
from common.daemon import run_daemon
from common.node import parse_config
from common.serving.context import PreparedRequest
from prefill_node.connector import ProducerConnector


def prepare_request(prepared: PreparedRequest, http_request: Request) -> None:
    """A prefill leg produces exactly the first token, whatever the body asked for."""
    prepared.params.max_tokens = 1
    prepared.params.stop = []  # the decode side applies stop strings to the whole text


def serve(config: NodeConfig) -> None:
    run_daemon(config, ProducerConnector(), prepare_request)


def main(argv: list[str] | None = None) -> None:
    """``pdserve prefill`` / ``python -m prefill_node``."""
    serve(parse_config(argv, "prefill"))
