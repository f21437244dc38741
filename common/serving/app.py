"""``build_app``: the OpenAI-compatible HTTP app every node role serves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from common.config import NodeConfig
from common.engine.protocol import EngineClient
from common.metrics import NodeMetrics
from common.serving import chat, completions, system
from common.serving.context import PrepareHook, ServingContext
from common.serving.errors import install_error_handlers
from common.serving.limits import BodyLimits
from common.serving.write_stall import bound_writes


def build_app(
    engine: EngineClient,
    tokenizer: Any,
    config: NodeConfig,
    metrics: NodeMetrics,
    *,
    ready: Callable[[], bool] | None = None,
    prepare_request: PrepareHook | None = None,
) -> FastAPI:
    """Routes over ``engine``; ``ready`` gates /ready, ``prepare_request`` lets a role adjust requests.

    ``prepare_request(prepared, http_request)`` runs before the range checks (may be async); it
    can change ``prepared.params`` / ``prepared.kv_transfer_params`` or raise ``OpenAIError``.
    """
    app = FastAPI(title=f"pdserve {config.role} node", version="0.1.0")
    metrics.bind_engine_stats(engine.stats)
    app.state.serving = ServingContext(
        engine=engine,
        tokenizer=tokenizer,
        config=config,
        metrics=metrics,
        ready=ready or (lambda: True),
        prepare_request=prepare_request,
    )
    install_error_handlers(app, metrics)
    app.add_middleware(BodyLimits, max_bytes=config.max_request_bytes)
    for module in (completions, chat, system):
        app.include_router(module.router)
    bound_writes(app, config.stream_write_timeout_s)
    return app
