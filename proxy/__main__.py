"""``pdserve proxy`` / ``python -m proxy``: the proxy's start-up, top to bottom.

Flags -> logging (every line names the proxy and its address, uvicorn's own lines too) -> the
HTTP and registry addresses and ports checked (keyless: loopback only, unless
--insecure-keyless-network; a taken port is one line and exit 1, common/node/startup.py) -> the
app (its lifespan starts the registry) -> uvicorn until SIGTERM / SIGINT.
"""

from __future__ import annotations

import uvicorn

from common.config import load_config
from common.logging_setup import configure_logging
from common.node.startup import check_keyless_binds, check_port_free, one_line_failures
from common.serving.http_server import HttpLimits, freeze_startup_heap, server_config
from proxy.app import build_app
from proxy.config import ProxyConfig

DESCRIPTION = (
    "The pdserve proxy: OpenAI API front that picks a prefill and a decode node, tags the request id "
    "and relays the decode node's answer. Nodes register over ZMQ or are listed statically."
)
PROG = "pdserve proxy"


def serve(config: ProxyConfig) -> None:
    """Run the proxy until interrupted."""
    configure_logging(config.log_level, f"proxy:{config.host}:{config.port}", config.log_file)
    check_keyless_binds(config.cluster_key_file is not None, config.insecure_keyless_network,
                        {"--host": config.host, "--registry-host": config.registry_host})
    check_port_free(config.host, config.port, "--port")
    check_port_free(config.registry_host, config.registry_port, "--registry-port")
    app = build_app(config)
    # Our own per-request log line names the tagged id and the pair; uvicorn's access log would repeat it.
    limits = HttpLimits(config.http_header_timeout_s, config.http_body_timeout_s, config.http_max_connections)
    server = uvicorn.Server(server_config(app, config.host, config.port, limits, log_config=None,
                                          log_level=config.log_level, access_log=False,
                                          timeout_keep_alive=config.keep_alive_timeout_s))
    freeze_startup_heap()
    server.run()


def main(argv: list[str] | None = None) -> None:
    config = load_config(ProxyConfig, argv, prog=PROG, description=DESCRIPTION)
    with one_line_failures(PROG):
        serve(config)


if __name__ == "__main__":
    main()
