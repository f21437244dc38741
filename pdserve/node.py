"""One serving node (role both, prefill or decode): engine + OpenAI app + uvicorn.

Start-up: logging -> the model (the embedded one is generated on first use) -> the
engine thread -> the HTTP app -> uvicorn. SIGTERM / SIGINT make uvicorn stop taking
connections and finish in-flight responses; the engine is shut down after it, which
ends any stream still open with "abort". An engine thread that dies (a step raised) takes
/ready and /health to 503 and stops uvicorn; the process exits with code 3.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI

from common.config import (DEFAULT_LOCAL_PREFILL_STALL_MS, EMBEDDED_MODEL_NAME, ROLE_HTTP_PORTS, ROLE_KV_PORTS,
                           NodeConfig, load_config)
from common.logging_setup import configure_logging
from common.metrics import NodeMetrics
from common.serving.app import build_app
from common.serving.context import PrepareHook
from common.serving.http_server import HttpLimits, server_config

if TYPE_CHECKING:
    from common.engine.async_engine import AsyncLLMEngine
    from common.engine.config import EngineConfig
    from common.engine.kv_connector import KVConnector

logger = logging.getLogger(__name__)

ENGINE_DEAD_EXIT_CODE = 3  # the engine thread died: a supervisor should restart the node
COMMANDS = {"both": "serve", "prefill": "prefill", "decode": "decode"}
DESCRIPTIONS = {
    "both": "Serve a model colocated (prefill and decode in one process): the baseline.",
    "prefill": "Run a prefill daemon: prompts in, KV pushed per layer to the decode daemon.",
    "decode": "Run a decode daemon: KV in from the prefill daemon, tokens streamed out.",
}


def resolve_engine_config(config: NodeConfig) -> EngineConfig:
    """The engine's config, with the embedded model generated under ``cache_dir`` if needed."""
    engine_config = config.engine_config()
    if engine_config.max_local_prefill_stall_ms is None and config.role == "decode":
        engine_config.max_local_prefill_stall_ms = DEFAULT_LOCAL_PREFILL_STALL_MS  # its local prefills
    if engine_config.model is None:
        from common.model.embedded import ensure_embedded_model

        model_dir = ensure_embedded_model(Path(config.cache_dir).expanduser() / "models")
        engine_config.model = str(model_dir)
        engine_config.served_model_name = engine_config.served_model_name or EMBEDDED_MODEL_NAME
    return engine_config


def run_node(
    config: NodeConfig,
    *,
    connector: KVConnector | None = None,
    ready: Callable[[], bool] | None = None,
    on_app: Callable[[FastAPI, AsyncLLMEngine], None] | None = None,
    prepare_request: PrepareHook | None = None,
) -> None:
    """Serve until SIGTERM / SIGINT.

    ``ready`` adds a role condition to /ready (e.g. "registered with the proxy");
    ``on_app(app, engine)`` lets a role add routes or a lifespan before serving;
    ``prepare_request`` is the serving layer's per-request hook (see ``build_app``).
    """
    configure_logging(config.log_level, f"{config.role}:{config.port}", config.log_file)
    from common.engine.async_engine import AsyncLLMEngine

    engine_config = resolve_engine_config(config)
    logger.info("loading %s on %s", engine_config.model, engine_config.device)
    engine = AsyncLLMEngine(engine_config, connector)
    engine.start()
    try:
        app = _build(engine, config, ready, prepare_request)
        if on_app is not None:
            on_app(app, engine)
        logger.info(
            "serving %s as role %s on http://%s:%d (max_model_len %d)",
            engine.model_name, config.role, config.host, config.port, engine.max_model_len,
        )
        limits = HttpLimits(config.http_header_timeout_s, config.http_body_timeout_s, config.http_max_connections)
        server = uvicorn.Server(
            server_config(app, config.host, config.port, limits, log_config=None,
                          timeout_graceful_shutdown=30, timeout_keep_alive=config.keep_alive_timeout_s)
        )
        engine.on_dead = lambda reason: setattr(server, "should_exit", True)  # /ready already says 503
        _serve_until_signal(server)
        if engine.dead_reason is not None:
            logger.critical("exiting: the engine thread stopped (%s); restart this node", engine.dead_reason)
            raise SystemExit(ENGINE_DEAD_EXIT_CODE)
    finally:
        engine.shutdown()
        logger.info("stopped")


class _Terminated(Exception):
    """SIGTERM arrived; uvicorn already drained, now the engine may stop."""


def _serve_until_signal(server: uvicorn.Server) -> None:
    """Run uvicorn; return normally after a graceful SIGTERM / SIGINT.

    uvicorn re-raises the signal it caught once it has drained; with the default SIGTERM
    action that would kill the process before the engine is shut down, so a handler of
    ours turns it into an exception here.
    """

    def on_sigterm(signum: int, frame: object) -> None:
        raise _Terminated()

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if in_main else None
    try:
        server.run()
    except (_Terminated, KeyboardInterrupt):
        logger.info("signal received; in-flight requests drained")
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def _build(
    engine: AsyncLLMEngine, config: NodeConfig, ready: Callable[[], bool] | None, prepare: PrepareHook | None
) -> FastAPI:
    def is_ready() -> bool:
        if engine.dead_reason is not None:
            return False
        return ready() if ready is not None else True

    return build_app(engine, engine.tokenizer, config, NodeMetrics(config.role), ready=is_ready,
                     prepare_request=prepare)


def parse_config(argv: list[str] | None, role: str) -> NodeConfig:
    """``pdserve serve|prefill|decode`` flags (env, TOML) with the role fixed by the command."""
    return load_config(
        NodeConfig,
        argv,
        prog=f"pdserve {COMMANDS[role]}",
        description=DESCRIPTIONS[role],
        fixed={"role": role},
        defaults={"port": ROLE_HTTP_PORTS[role], "kv_port": ROLE_KV_PORTS[role]},
    )


def main(argv: list[str] | None = None, role: str = "both", **run_kwargs: Any) -> None:
    """``pdserve serve``: parse flags and serve colocated."""
    run_node(parse_config(argv, role), **run_kwargs)
