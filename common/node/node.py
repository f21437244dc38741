"""One serving node (role both, prefill or decode): the steps every role starts with, and
``pdserve serve``, the colocated node, which is only those steps.

Start-up, top to bottom (``serve``): logging -> the ports and the device checked (before
minutes of model loading) -> the model (the default one fetched, a GGUF converted, once) -> the engine thread -> the
HTTP app -> uvicorn. A start that cannot succeed prints one line and exits 1
(common/node/startup.py). SIGTERM / SIGINT make uvicorn stop taking connections and finish
in-flight responses; the engine is shut down after it, which ends any stream still open with
"abort". An engine thread that dies (a step raised) takes /ready and /health to 503 and stops
uvicorn; the process exits with code 3. The daemons (common/node/daemon.py) add their KV endpoint
and registration between the engine and the app.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from common.config import ROLE_HTTP_PORTS, ROLE_KV_PORTS, NodeConfig, load_config
from common.logging_setup import configure_logging
from common.metrics import NodeMetrics
from common.node.startup import check_keyless_binds, check_port_free, one_line_failures
from common.serving.app import build_app
from common.serving.context import PrepareHook
from common.serving.http_server import HttpLimits, freeze_startup_heap, server_config

if TYPE_CHECKING:
    from common.engine.async_engine import AsyncLLMEngine
    from common.engine.kv_connector import KVConnector

logger = logging.getLogger(__name__)

ENGINE_DEAD_EXIT_CODE = 3  # the engine thread died: a supervisor should restart the node
COMMANDS = {"both": "serve", "prefill": "prefill", "decode": "decode"}
DESCRIPTIONS = {
    "both": "Serve a model colocated (prefill and decode in one process): the baseline.",
    "prefill": "Run a prefill daemon: prompts in, KV pushed per layer to the decode daemon.",
    "decode": "Run a decode daemon: KV in from the prefill daemon, tokens streamed out.",
}


def serve(config: NodeConfig) -> None:
    """``pdserve serve``: a colocated node until SIGTERM / SIGINT."""
    from common.node.role_routes import refuse_role_flips

    start_logging(config)
    check_machine(config)
    config = with_model(config)
    engine = start_engine(config)
    try:
        app = node_app(engine, config, NodeMetrics(config.role, config.tensor_parallel_size))
        refuse_role_flips(app)
        serve_http(app, engine, config)
    finally:
        engine.shutdown()
        logger.info("stopped")


def main(argv: list[str] | None = None, role: str = "both") -> None:
    """``pdserve serve``: parse the flags, then serve colocated."""
    config = parse_config(argv, role)
    with one_line_failures(f"pdserve {COMMANDS[role]}"):
        serve(config)


# ---- the steps, in the order a node takes them -------------------------------------------
def start_logging(config: NodeConfig) -> None:
    """Every line from here on names the node (its role and the address it is reached at)."""
    configure_logging(config.log_level, f"{config.role}:{config.kv_host}:{config.port}", config.log_file)


def check_ports(config: NodeConfig) -> None:
    """The HTTP port (and a daemon's KV port) free, and a keyless daemon on loopback only
    (StartupError); needs no torch, so a daemon's ``__main__`` asks it before it imports the
    daemon's modules."""
    if config.role != "both":  # a colocated node has no peers: a key would change nothing
        check_keyless_binds(config.cluster_key_file is not None, config.insecure_keyless_network,
                            {"--host": config.host, "--kv-host": config.kv_host or ""})
    check_port_free(config.host, config.port or 0, "--port")
    if config.role != "both":
        check_port_free(config.host, config.kv_port or 0, "--kv-port")
        for rank in range(1, config.kv_rank_count):  # each KV rank's endpoint (tp_ranks, tp_slices)
            check_port_free(config.host, (config.kv_port or 0) + rank, f"--kv-port + {rank} (KV rank {rank})")
        if config.kv_events_port and config.proxy:  # the KV events' PUB, and its replay at the next port
            check_port_free(config.host, config.kv_events_port, "--kv-events-port")
            check_port_free(config.host, config.kv_events_port + 1, "--kv-events-port + 1 (replay)")


def check_machine(config: NodeConfig) -> None:
    """What this machine must offer before a model is loaded: the ports free, and the device
    there (StartupError, EngineConfigError)."""
    check_ports(config)
    device = config.resolved_device()
    if device.type == "cuda" and device.index is not None:
        import torch

        torch.cuda.set_device(device)  # kernels, streams and graphs go to the current device


def with_model(config: NodeConfig) -> NodeConfig:
    """``config`` naming the model directory to load: ``--model`` resolved (common/model/sources.py):
    unset, the default model (fetched and converted once under ``--cache-dir``); ``embedded``, the
    tiny random model (generated on first use); a GGUF, converted once."""
    from common.model.sources import resolve_model

    model_dir, name = resolve_model(config.model, config.cache_dir)
    return config.model_copy(update={"model": str(model_dir), "served_model_name": config.served_model_name or name})


def start_engine(config: NodeConfig, connector: KVConnector | None = None, start: bool = True,
                 rank_main: str | None = None) -> AsyncLLMEngine:
    """Load the model and start the engine thread (the node's config is the engine's); ``start``
    False: the caller starts it; ``rank_main``: the module tensor-parallel worker ranks run (None:
    the engine's own). A tensor-parallel worker rank that dies ends the process."""
    from common.engine.async_engine import AsyncLLMEngine
    from common.engine.parallel import RANK_MAIN, exit_on_rank_loss

    logger.info("loading %s on %s", config.model, config.resolved_device())
    engine = AsyncLLMEngine(config, connector, rank_main or RANK_MAIN)
    exit_on_rank_loss(engine.engine.runner.leader, ENGINE_DEAD_EXIT_CODE)
    if start:
        engine.start()
    return engine


def node_app(
    engine: AsyncLLMEngine, config: NodeConfig, metrics: NodeMetrics,
    ready: Callable[[], bool] | None = None, prepare_request: PrepareHook | None = None,
) -> FastAPI:
    """The OpenAI app over ``engine``; /ready also needs ``ready()`` (e.g. "registered")."""

    def is_ready() -> bool:
        if engine.dead_reason is not None:
            return False
        return ready() if ready is not None else True

    return build_app(engine, engine.tokenizer, config, metrics, ready=is_ready, prepare_request=prepare_request)


def serve_http(app: FastAPI, engine: AsyncLLMEngine, config: NodeConfig) -> None:
    """uvicorn until SIGTERM / SIGINT (in-flight requests drained); exit 3 if the engine died."""
    logger.info("serving %s as role %s on http://%s:%d (max_model_len %d)",
                engine.model_name, config.role, config.host, config.port, engine.max_model_len)
    limits = HttpLimits(config.http_header_timeout_s, config.http_body_timeout_s, config.http_max_connections)
    server = uvicorn.Server(
        server_config(app, config.host, config.port, limits, log_config=None,
                      timeout_graceful_shutdown=30, timeout_keep_alive=config.keep_alive_timeout_s)
    )
    engine.on_dead = lambda reason: setattr(server, "should_exit", True)  # /ready already says 503
    freeze_startup_heap()
    _serve_until_signal(server)
    if engine.dead_reason is not None:
        logger.critical("exiting: the engine thread stopped (%s); restart this node", engine.dead_reason)
        raise SystemExit(ENGINE_DEAD_EXIT_CODE)


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
