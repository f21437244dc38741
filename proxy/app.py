"""The proxy's FastAPI app: the OpenAI routes users call, plus health, readiness, metrics.

``build_app`` wires the pieces; its lifespan owns the one pooled HTTP transport
and the registry's listener thread, so nothing outlives the app.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from starlette.responses import JSONResponse, Response

from proxy.config import ProxyConfig
from proxy.errors import ProxyError, Unauthorized, error_body
from proxy.legs import Legs
from proxy.metrics import ProxyMetrics
from proxy.registry import ServiceRegistry
from proxy.relay import Dispatcher
from proxy.routing import Router
from proxy.transport import PooledTransport


def registry_from_config(config: ProxyConfig) -> ServiceRegistry:
    return ServiceRegistry(
        host=config.registry_host,
        port=config.registry_port,
        heartbeat_timeout_s=config.heartbeat_timeout_s,
        sweep_interval_s=config.sweep_interval_s,
        static_nodes=config.static_nodes(),
    )


def build_app(config: ProxyConfig, registry: ServiceRegistry | None = None) -> FastAPI:
    """The proxy app; the registry starts and stops with it."""
    registry = registry or registry_from_config(config)
    router = Router(registry, config.policy)
    metrics = ProxyMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        registry.start()
        async with PooledTransport(max_idle_per_origin=config.max_idle_connections,
                                   connect_timeout_s=config.connect_timeout_s) as transport:
            app.state.dispatcher = Dispatcher(Legs(transport, config, metrics), router, config, metrics)
            try:
                yield
            finally:
                registry.stop()

    app = FastAPI(title="pdserve proxy", lifespan=lifespan)
    app.state.config, app.state.registry, app.state.router, app.state.metrics = config, registry, router, metrics

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, exc: ProxyError) -> Response:
        metrics.count_error(exc.kind)
        return exc.response()

    app.include_router(_openai_routes(config, router), dependencies=[Depends(_api_key_check(config))])
    _add_ops_routes(app, router, registry, metrics)
    return app


def _api_key_check(config: ProxyConfig):
    expected = f"Bearer {config.api_key}".encode() if config.api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise Unauthorized("missing or wrong API key: send 'Authorization: Bearer <key>'")

    return check


def _openai_routes(config: ProxyConfig, router: Router) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await request.app.state.dispatcher.handle(request, "/v1/completions")

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await request.app.state.dispatcher.handle(request, "/v1/chat/completions")

    @api.get("/v1/models")
    async def models() -> dict:
        created = int(time.time())
        data = [{"id": m, "object": "model", "created": created, "owned_by": "pdserve"} for m in router.models()]
        return {"object": "list", "data": data}

    return api


def _add_ops_routes(app: FastAPI, router: Router, registry: ServiceRegistry, metrics: ProxyMetrics) -> None:
    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        if router.has_pair():
            return JSONResponse({"status": "ready", "nodes": registry.counts()})
        message = f"no compatible prefill/decode pair registered yet (nodes: {registry.counts()})"
        return JSONResponse(error_body(message, "service_unavailable", 503), status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(registry.counts()), media_type="text/plain; version=0.0.4")
