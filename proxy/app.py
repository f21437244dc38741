"""The proxy's FastAPI app: the OpenAI routes users call, plus health, readiness, metrics.

``build_app`` wires the pieces; its lifespan owns the one pooled HTTP transport
and the registry's listener thread, so nothing outlives the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp

from common.cluster_auth import ClusterKey, warn_if_open
from common.serving.errors import error_body, error_type, http_error
from common.serving.limits import BodyLimits
from common.serving.write_stall import bound_writes
from proxy.api_key import ApiKeyOnly
from proxy.config import ProxyConfig
from proxy.errors import NoNodeAvailable, ProxyError
from proxy.exact_prefix import ExactPrefix
from proxy.kv_index import KVIndex
from proxy.kv_subscriber import KVEventSubscriber
from proxy.legs import Legs
from proxy.metrics import ProxyMetrics
from proxy.model_cards import ModelCards
from proxy.pairing import PairingWatch
from proxy.planner_loop import start_planner
from proxy.registry import ServiceRegistry
from proxy.relay import Dispatcher
from proxy.relay_routes import ErrorHandler, RelayRoutes, serve_relay_first
from proxy.routing import Router
from proxy.transport import PooledTransport

logger = logging.getLogger(__name__)


def registry_from_config(config: ProxyConfig) -> ServiceRegistry:
    key = ClusterKey.optional(config.cluster_key_file)
    warn_if_open("proxy registry", config.registry_host, key, "register a node and receive clients' prompts")
    return ServiceRegistry(
        host=config.registry_host,
        port=config.registry_port,
        heartbeat_timeout_s=config.heartbeat_timeout_s,
        sweep_interval_s=config.sweep_interval_s,
        static_nodes=config.static_nodes(),
        key=key,
        max_nodes=config.max_nodes,
    )


def build_app(config: ProxyConfig, registry: ServiceRegistry | None = None) -> FastAPI:
    """The proxy app; the registry starts and stops with it."""
    registry = registry or registry_from_config(config)
    metrics = ProxyMetrics()
    # the nodes' KV events, indexed (proxy/exact_prefix.py): every node's when a policy reads prefixes,
    # else only the peer fetchers' (--kv-peer-fetch on), for the peer hint; none runs it, none is followed
    reads_prefixes = config.policy == "prefix_aware" or config.disagg_policy == "auto"
    index = KVIndex(config.kv_index_max_blocks, max_nodes=config.max_nodes)
    subscriber = KVEventSubscriber(registry, index, ClusterKey.optional(config.cluster_key_file),
                                   stale_s=config.heartbeat_timeout_s,
                                   follows=None if reads_prefixes else lambda node: bool(node.kv_peer_fetch))
    exact = ExactPrefix(index, registry.peer_fetchers)
    router = Router(registry, config.policy, config.node_stall_timeout_s, config.unreachable_cooldown_s, exact=exact)
    router.on_route = metrics.count_route
    pairing = PairingWatch()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        registry.start()
        subscriber.start()
        watching = asyncio.ensure_future(_watch_pairing(pairing, registry))
        async with PooledTransport(max_idle_per_origin=config.max_idle_connections,
                                   connect_timeout_s=config.connect_timeout_s) as transport:
            legs = Legs(transport, config, metrics, unreachable=router.unreachable)
            app.state.dispatcher = Dispatcher(legs, router, config, metrics, exact)
            app.state.model_cards = ModelCards(registry)
            planning = start_planner(config, registry, metrics.registry, app.state.dispatcher.disagg)
            try:
                yield
            finally:
                for task in (watching, planning):
                    if task is not None:
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await task
                subscriber.stop()
                registry.stop()

    # FastAPI's OpenTelemetry bridge asks the OTel providers (reading os.environ) on every request,
    # ~6% of the proxy's CPU per request, for providers pdserve never sets up: its metrics are Prometheus
    app = FastAPI(title="pdserve proxy", lifespan=lifespan,
                  telemetry={"tracing": False, "metrics": False, "logs": False})
    app.state.config, app.state.registry = config, registry
    app.state.router, app.state.metrics = router, metrics

    on_proxy_error, on_unexpected = _add_error_handlers(app, metrics)
    app.add_middleware(BodyLimits, max_bytes=config.max_request_bytes)
    relay: ASGIApp = BodyLimits(RelayRoutes(app, on_proxy_error, on_unexpected), max_bytes=config.max_request_bytes)
    if config.api_key:  # outermost: a stranger's body is never read
        def refused() -> None:
            metrics.count_error("unauthorized")

        app.add_middleware(ApiKeyOnly, api_key=config.api_key, on_refused=refused)
        relay = ApiKeyOnly(relay, api_key=config.api_key, on_refused=refused)
    app.include_router(_openai_routes(config, router))
    _add_ops_routes(app, router, registry, metrics, pairing, subscriber)
    serve_relay_first(app, relay)  # the relay POSTs skip FastAPI's layers (proxy/relay_routes.py)
    bound_writes(app, config.stream_write_timeout_s)
    return app


def _add_error_handlers(app: FastAPI, metrics: ProxyMetrics) -> tuple[ErrorHandler, ErrorHandler]:
    """Every answer the proxy itself makes is an OpenAI error body (unknown path, wrong method, a bug).
    Returns the handlers of a ProxyError and of a bug, which the relay routes call themselves."""

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, exc: ProxyError) -> Response:
        metrics.count_error(exc.kind)
        return exc.response(request.headers.get("x-request-id"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        metrics.count_error("bad_request")
        response = http_error(request, exc.status_code, str(exc.detail)).response()
        response.headers.update(exc.headers or {})  # 405's Allow
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error serving %s %s", request.method, request.url.path)
        metrics.count_error("internal")
        error = ProxyError("internal proxy error; see the proxy log")
        return error.response(request.headers.get("x-request-id"))

    return _proxy_error, _unexpected


def _openai_routes(config: ProxyConfig, router: Router) -> APIRouter:
    api = APIRouter()
    # POSTs to the relay routes are answered by RelayRoutes in front of the app (proxy/relay_routes.py);
    # these entries keep them in the OpenAPI schema and give their other methods the router's 405.

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await request.app.state.dispatcher.handle(request, "/v1/completions")

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await request.app.state.dispatcher.handle(request, "/v1/chat/completions")

    @api.get("/v1/models")
    async def models(request: Request) -> dict:
        return {"object": "list", "data": await request.app.state.model_cards.cards(router.models())}

    return api


async def _watch_pairing(pairing: PairingWatch, registry: ServiceRegistry, interval_s: float = 1.0) -> None:
    """Logs a node no live peer can pair with soon after it registers, whether or not /ready is asked."""
    while True:
        pairing.check(registry.groups())
        await asyncio.sleep(interval_s)


def _add_ops_routes(app: FastAPI, router: Router, registry: ServiceRegistry, metrics: ProxyMetrics,
                    pairing: PairingWatch, subscriber: KVEventSubscriber | None) -> None:
    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        """Ready once a compatible pair is registered. ``nodes`` counts the registered nodes by role,
        ``ready_nodes`` those that can pair; ``unpaired`` names each other one and why."""
        unpaired = pairing.check(registry.groups())
        counts = registry.counts()
        ready_nodes = dict(counts)
        for u in unpaired:
            ready_nodes[u.type] -= 1
        if router.has_pair() and registry.listening:
            return JSONResponse({"status": "ready", "nodes": counts, "ready_nodes": ready_nodes,
                                 "unpaired": [u.to_dict() for u in unpaired]})
        message = f"no compatible prefill/decode pair registered yet (nodes: {counts})"
        if unpaired:
            message += "; " + "; ".join(f"{u.type} {u.http_address}: {u.reason}" for u in unpaired[:8])
        return JSONResponse(error_body(message, error_type(503), None, NoNodeAvailable.code), status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        if subscriber is not None:
            applied = subscriber.applied()
            metrics.observe_kv_events(len(subscriber.index), applied,
                                      {k: subscriber.index.is_fresh(k) for k in applied}, subscriber.rejected())
        text = metrics.render(registry.counts(), registry.rejected())
        return Response(text, media_type="text/plain; version=0.0.4")
