"""A prefill or decode daemon that can become the other: ``serve_daemon`` builds one app with both
roles' HTTP hooks, each acting only while the node has its role, and the role flip's routes
(common/node/role_flip.py, common/node/role_routes.py).

Start-up, top to bottom: the daemon (engine, KV endpoint, heartbeats; ``started_daemon``) with the
starting role's connector -> the flipper (role, epoch, state) -> the app: each role's request hook
(``prepare``) behind one dispatcher, each role's middleware and metrics (``install``), the signed-id
check, then ``POST /admin/role`` and the role gate outermost -> HTTP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from fastapi import FastAPI, Request

from common.cluster_auth import SIGNATURE_HEADER
from common.config import NodeConfig
from common.node.daemon import Daemon, started_daemon
from common.node.node import serve_http
from common.node.role_flip import RoleFlipper
from common.node.role_routes import EPOCH_STATE, add_role_routes
from common.serving.errors import OpenAIError

if TYPE_CHECKING:
    from common.engine.kv_connector import KVConnector
    from common.serving.context import PrepareHook, PreparedRequest


class DaemonRole(Protocol):
    """What one role adds to a daemon (prefill_node.daemon.PrefillRole, decode_node.daemon.DecodeRole)."""

    def connector(self) -> KVConnector:
        """A fresh engine connector of this role (at start, and at each flip to it)."""
        ...

    def prepare(self, daemon: Daemon) -> PrepareHook | None:
        """The role's ``prepare_request`` (run only while the node has this role), or None."""
        ...

    def install(self, app: FastAPI, daemon: Daemon) -> None:
        """The role's middleware and metrics, installed once; they act only while the node has this role."""
        ...


def serve_daemon(config: NodeConfig, roles: dict[str, DaemonRole]) -> None:
    """``pdserve prefill|decode``: a daemon in ``config.role`` until SIGTERM / SIGINT, flippable to the other."""
    with started_daemon(config, roles[config.role].connector()) as daemon:
        flipper = daemon.flipper = RoleFlipper(daemon, {r: role.connector for r, role in roles.items()},
                                               config.drain_timeout_s)
        hooks = {r: hook for r, role in roles.items() if (hook := role.prepare(daemon)) is not None}

        def prepare(prepared: PreparedRequest, http_request: Request) -> object:
            try:
                flipper.check_admitted(getattr(http_request.state, EPOCH_STATE, None))
            except OpenAIError:
                if daemon.config.role != "decode":  # a decode node's own middleware releases it (decode_node.release)
                    headers = http_request.headers
                    flipper.release_refused(headers.get("x-request-id"), headers.get(SIGNATURE_HEADER))
                raise
            hook = hooks.get(daemon.config.role)
            return hook(prepared, http_request) if hook is not None else None

        app = daemon.build_app(prepare_request=prepare)  # type: ignore[arg-type]
        flipper.on_role = lambda: app.state.serving.set_role(daemon.config)
        for role in roles.values():
            role.install(app, daemon)
        daemon.require_signed_ids(app)
        add_role_routes(app, flipper, daemon.key, config.insecure_keyless_network)
        serve_http(app, daemon.engine, config)
