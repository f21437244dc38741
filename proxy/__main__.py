"""``pdserve proxy`` / ``python -m proxy``: parse the config, start the app under uvicorn."""

from __future__ import annotations

import uvicorn

from common.config import load_config
from common.logging_setup import configure_logging
from common.serving.http_server import HttpLimits, server_config
from proxy.app import build_app
from proxy.config import ProxyConfig

DESCRIPTION = (
    "The pdserve proxy: OpenAI API front that picks a prefill and a decode node, tags the request id "
    "and relays the decode node's answer. Nodes register over ZMQ or are listed statically."
)


def main(argv: list[str] | None = None) -> None:
    """Run the proxy until interrupted."""
    config = load_config(ProxyConfig, argv, prog="pdserve proxy", description=DESCRIPTION)
    configure_logging(config.log_level, f"proxy:{config.port}", config.log_file)
    app = build_app(config)
    # Our own per-request log line names the tagged id and the pair; uvicorn's access log would repeat it.
    limits = HttpLimits(config.http_header_timeout_s, config.http_body_timeout_s, config.http_max_connections)
    uvicorn.Server(server_config(app, config.host, config.port, limits, log_level=config.log_level,
                                 access_log=False, timeout_keep_alive=config.keep_alive_timeout_s)).run()


if __name__ == "__main__":
    main()
