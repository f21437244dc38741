"""The HTTP side of a role flip (common/node/role_flip.py): ``POST /admin/role`` and the gate every
request passes.

``POST /admin/role`` takes ``{"role": "prefill"|"decode", "epoch": N}`` (N: the role epoch the caller
expects the node to be at) and answers, once the flip is done, 200 ``{"role", "epoch", "flip_s",
"drain_s", "aborted"}``; 409 (stale epoch, a flip already running, not supported here) or 500 (the
node is fenced) with an OpenAI error body and the node's ``role``, ``epoch`` and ``state``; 400 for a
bad body. Who may call it:

- with a cluster key, a caller holding it: ``X-Request-Id`` and ``X-PDServe-Signature`` made for
  the ``admin`` role over the exact body (``common.cluster_auth.admin_headers``), accepted once and
  until it expires. No signature: 401; a bad, expired, replayed one or another body: 403;
- keyless, a caller on loopback (a keyless daemon listens on loopback only, unless
  ``--insecure-keyless-network`` says the network is trusted: then anyone, as for its other routes).

``RoleGate`` (outermost middleware) counts the requests in flight for the drain and refuses, before
anything else reads them: a leg for the role the node no longer has (409 ``stale_role``), any request
while it drains (409 ``node_draining``) or is fenced (503 ``node_fenced``). GET /health and /ready say
503 while fenced, /ready also while draining.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from common.cluster_auth import ADMIN_ROLE, ID_TTL_S, SIGNATURE_HEADER, ClusterKey, ReplayWindow, is_loopback
from common.node.role_flip import ROLES, FlipFailed, FlipRefused, RoleFlipper
from common.serving.errors import REQUEST_ID_HEADER, OpenAIError

logger = logging.getLogger(__name__)
ROLE_PATH = "/admin/role"
_ID, _SIG = b"x-request-id", SIGNATURE_HEADER.lower().encode()
EPOCH_STATE = "pdserve_role_epoch"  # the role epoch a request was admitted at (request.state)


class RoleGate:
    """Outermost ASGI middleware of a daemon whose role may flip (module docstring)."""

    def __init__(self, app: ASGIApp, flipper: RoleFlipper) -> None:
        self.app, self.flipper = app, flipper

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        flipper = self.flipper
        if scope["type"] != "http" or scope["path"].startswith("/admin/"):
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":
            if flipper.role_state != "serving" and scope["path"] in ("/health", "/ready"):
                if scope["path"] == "/ready" or flipper.role_state == "fenced":
                    body = {"status": flipper.role_state, "role": flipper.role, "role_epoch": flipper.epoch,
                            **({"error": flipper.fence_reason} if flipper.role_state == "fenced" else {})}
                    await JSONResponse(body, status_code=503)(scope, receive, send)
                    return
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        request_id, signature = (headers[h].decode("latin-1") if h in headers else None for h in (_ID, _SIG))
        refusal = flipper.admit(request_id)
        if refusal is not None:
            status, code, message = refusal
            logger.info("refused %s (request %s): %s", scope["path"], request_id, message)
            flipper.release_refused(request_id, signature)  # a decode leg's KV waits on a prefill node
            await _error(status, message, code, None, flipper)(scope, receive, send)
            return
        scope.setdefault("state", {})[EPOCH_STATE] = flipper.epoch  # checked again before the engine (check_admitted)
        try:
            await self.app(scope, receive, send)
        finally:
            flipper.done()


def add_role_routes(app: FastAPI, flipper: RoleFlipper, key: ClusterKey | None, insecure_keyless: bool) -> None:
    """``POST /admin/role`` and the gate (added last: outermost)."""
    seen = ReplayWindow(2 * ID_TTL_S)

    @app.post(ROLE_PATH, include_in_schema=False)
    async def set_role(request: Request) -> JSONResponse:
        body = await request.body()
        refusal = _unauthorized(request, body, key, insecure_keyless, seen)
        if refusal is not None:
            status, message = refusal
            logger.warning("POST %s refused: %s", ROLE_PATH, message)
            code = "unauthorized" if status == 401 else "forbidden"
            return _error(status, message, code, None, flipper, "authentication_error")
        try:
            role, epoch = _parse(body)
        except OpenAIError as exc:
            return exc.response()
        try:
            result = await asyncio.to_thread(flipper.flip, role, epoch)
        except FlipRefused as exc:
            return _error(409, str(exc), exc.code, exc.param, flipper)
        except FlipFailed as exc:
            return _error(500, str(exc), "role_flip_failed", None, flipper, "server_error")
        return JSONResponse({"role": result.role, "epoch": result.epoch, "flip_s": round(result.flip_s, 4),
                             "drain_s": round(result.drain_s, 4), "aborted": result.aborted})

    app.add_middleware(RoleGate, flipper=flipper)


def refuse_role_flips(app: FastAPI) -> None:
    """A colocated node (``pdserve serve``) has no role to flip: ``POST /admin/role`` says so (409)."""

    @app.post(ROLE_PATH, include_in_schema=False)
    async def set_role() -> JSONResponse:
        raise OpenAIError("a colocated node (pdserve serve) prefills and decodes in one process: it has no role "
                          "to flip; flip a prefill or decode daemon", status=409, type="conflict_error",
                          code="role_flip_unsupported")


def _unauthorized(request: Request, body: bytes, key: ClusterKey | None, insecure_keyless: bool,
                  seen: ReplayWindow) -> tuple[int, str] | None:
    """(status, why) when the caller may not flip this node, else None (module docstring)."""
    if key is None:
        host = request.client.host if request.client is not None else ""
        if insecure_keyless or is_loopback(host):
            return None
        return 403, (f"this keyless node takes {ROLE_PATH} from loopback only, not from {host}; set "
                     "--cluster-key-file and sign the call with it")
    request_id, signature = request.headers.get(REQUEST_ID_HEADER), request.headers.get(SIGNATURE_HEADER)
    if not request_id or not signature:
        return 401, (f"{ROLE_PATH} needs {REQUEST_ID_HEADER} and {SIGNATURE_HEADER} signed with the cluster key "
                     "for the admin role (common.cluster_auth.admin_headers)")
    reason = key.check_id(request_id, signature, ADMIN_ROLE)
    if reason is None and hashlib.sha256(body).hexdigest() != key.signed_body_digest(signature):
        reason = "the body is not the one the call was signed with"
    if reason is None and not seen.first_time(signature.encode("latin-1")):
        reason = "this signature was already used"
    return None if reason is None else (403, f"forbidden: {reason}")


def _parse(body: bytes) -> tuple[str, int]:
    """``role`` and ``epoch`` of a well-formed body; OpenAIError (400) else."""
    def bad(message: str, param: str | None = None) -> OpenAIError:
        return OpenAIError(message, status=400, param=param, code="invalid_role_request")

    try:
        data = json.loads(body)
    except ValueError:
        raise bad('the body must be JSON: {"role": "prefill"|"decode", "epoch": <int>}') from None
    if not isinstance(data, dict):
        raise bad('the body must be a JSON object: {"role": "prefill"|"decode", "epoch": <int>}')
    unknown = sorted(set(data) - {"role", "epoch"})
    if unknown:
        raise bad(f"unknown field(s): {', '.join(unknown)}", unknown[0])
    role, epoch = data.get("role"), data.get("epoch")
    if role not in ROLES:
        raise bad(f"role must be one of {', '.join(ROLES)}, got {role!r}", "role")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch < 2**62:
        raise bad(f"epoch must be the node's role epoch, an integer >= 0, got {epoch!r}", "epoch")
    return role, epoch


def _error(status: int, message: str, code: str, param: str | None, flipper: RoleFlipper,
           type_: str = "conflict_error") -> JSONResponse:
    """An OpenAI error body with the node's role, epoch and state beside it (a planner reads them)."""
    if status == 503:
        type_ = "service_unavailable_error"
    body = {"error": {"message": message, "type": type_, "param": param, "code": code},
            "role": flipper.role, "epoch": flipper.epoch, "state": flipper.role_state}
    return JSONResponse(body, status_code=status)
