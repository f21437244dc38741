"""Log lines that say which node and which request they belong to.

Every line carries the process (``role:host:port``: a node's address as peers reach it, the
proxy's as it binds) and the id of the request being served (``-`` outside one), so the
proxy's, prefill's and decode's logs of one request can be matched with one grep for its id.
"""

from __future__ import annotations

import logging
import sys
from contextvars import ContextVar

# A ContextVar, not a global: each asyncio task (one per HTTP request) sees its own value.
current_request_id: ContextVar[str] = ContextVar("pdserve_request_id", default="-")

LOG_FORMAT = "%(asctime)s %(levelname)s [%(node)s] [%(request_id)s] %(name)s: %(message)s"


class _NodeFilter(logging.Filter):
    def __init__(self, node: str) -> None:
        super().__init__()
        self.node = node

    def filter(self, record: logging.LogRecord) -> bool:
        record.node = self.node
        record.request_id = current_request_id.get()
        return True


def configure_logging(level: str, node: str, log_file: str | None = None) -> None:
    """Root logging to stderr (and ``log_file``) with node and request id on every line; call it
    before uvicorn starts and give uvicorn ``log_config=None``, so its lines carry them too."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        handlers.append(logging.FileHandler(log_file))
    for handler in handlers:
        handler.addFilter(_NodeFilter(node))
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level.upper())
    # uvicorn's access log repeats every request at INFO; keep it for debug runs only.
    logging.getLogger("uvicorn.access").setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
