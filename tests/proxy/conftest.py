"""Fixtures: fake nodes behind real uvicorn servers, and a proxy in front of them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from proxy_fakes import FakeNode, ServerThread, stop_servers

from proxy.app import build_app, registry_from_config
from proxy.config import ProxyConfig


@dataclass
class Cluster:
    proxy: ServerThread
    app: object
    prefills: list[FakeNode]
    decodes: list[FakeNode]
    kv_of: dict[str, str]  # fake node name -> its advertised KV address

    @property
    def url(self) -> str:
        return self.proxy.url


@pytest.fixture
def make_cluster():
    """``make_cluster(n_prefill=1, n_decode=1, **config)`` -> a running Cluster (static nodes); every
    server is stopped together after the test."""
    servers: list[ServerThread] = []

    def serve(app) -> ServerThread:
        servers.append(server := ServerThread(app))
        return server.start()

    def make(n_prefill: int = 1, n_decode: int = 1, **overrides) -> Cluster:
        prefills = [FakeNode("P", f"p{i}") for i in range(n_prefill)]
        decodes = [FakeNode("D", f"d{i}") for i in range(n_decode)]
        static: dict[str, list[str]] = {"P": [], "D": []}
        kv_of = {}
        for i, node in enumerate(prefills + decodes):
            server = serve(node.app)
            kv_of[node.name] = f"10.0.0.{i + 1}:{14000 + i}"  # never dialled by the proxy
            static[node.role].append(f"{server.address}@{kv_of[node.name]}@m@fp")
            node.http_address = server.address
        config = ProxyConfig(port=0, registry_port=0, static_prefill=static["P"], static_decode=static["D"],
                             **overrides)
        app = build_app(config, registry_from_config(config))
        return Cluster(serve(app), app, prefills, decodes, kv_of)

    try:
        yield make
    finally:
        stop_servers(servers)
