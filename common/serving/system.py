"""Operational routes: /health (liveness), /ready (serving), /metrics, /v1/models."""

from __future__ import annotations

import os
import time

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from common.metrics import CONTENT_TYPE
from common.serving.context import ServingContext, get_context

router = APIRouter()


@router.get("/health")
async def health(ctx: ServingContext = Depends(get_context)) -> Response:
    """200 as long as the process answers and its engine thread runs; 503 with the reason once
    that thread has died (the process is on its way out, see common/node/node.py)."""
    dead = getattr(ctx.engine, "dead_reason", None)
    if dead is not None:
        return JSONResponse({"status": "engine dead", "error": dead}, status_code=503)
    return JSONResponse({"status": "ok", "pid": os.getpid()})  # pid: a supervisor (or test) knows who answered


@router.get("/ready")
async def ready(ctx: ServingContext = Depends(get_context)) -> Response:
    """200 once the engine is loaded and the role's own condition (e.g. registered) holds."""
    if ctx.ready():
        return JSONResponse({"status": "ready", "role": ctx.config.role, "model": ctx.model_name,
                             "tensor_parallel_size": ctx.config.tensor_parallel_size})
    return JSONResponse({"status": "not ready", "role": ctx.config.role}, status_code=503)


@router.get("/metrics")
async def metrics(ctx: ServingContext = Depends(get_context)) -> Response:
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models")
async def models(ctx: ServingContext = Depends(get_context)) -> Response:
    card = {
        "id": ctx.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "pdserve",
        "max_model_len": ctx.engine.max_model_len,
    }
    return JSONResponse({"object": "list", "data": [card]})
