"""Who a request is from, for fair share between clients (common/engine/fairness.py).

In order: the bearer token of the ``Authorization`` header the node received (a client that
talks to the node directly; only a hash of it is kept), else the request's ``cache_salt`` (a
pdserve proxy with ``--cache-salt-from-api-key`` sets it from the client's API key; the proxy
does not forward ``Authorization``), else the OpenAI ``user`` field, else "" (one shared pool).
The ``user`` field and a salt are whatever the client says: fair share by them holds between
clients that do not lie about who they are; only distinct API keys are proof.
"""

from __future__ import annotations

import hashlib

from fastapi import Request

from common.serving.protocol import SamplingRequest


def client_id(request: Request, body: SamplingRequest) -> str:
    scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return "key:" + hashlib.sha256(token.strip().encode()).hexdigest()[:32]
    if body.cache_salt:
        return "salt:" + body.cache_salt
    if body.user:
        return "user:" + body.user
    return ""
