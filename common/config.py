"""The node (serve / prefill / decode) configuration: :class:`NodeConfig` and role defaults.

One schema from flags to engine: ``NodeConfig`` subclasses the engine's ``EngineConfig``, so
every engine option is a flag, a ``PDSERVE_*`` variable and a TOML key, validated once when
the flags are read, and the node hands the engine its own config.

The generic flags/env/TOML loader lives in :mod:`common.options`; its public names are
re-exported here so ``from common.config import load_config`` keeps working.
"""

from __future__ import annotations

import socket
from typing import Literal

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from common.cluster_auth import check_key_file
from common.defaults import (
    DEFAULT_CACHE_DIR,
    EMBEDDED_MODEL_NAME,
    MAX_HEARTBEAT_INTERVAL_S,
)
from common.engine.config import EngineConfig

# torch-free, as common.defaults: the launcher reads the flags (and checks --model once) without loading the model
from common.model.sources import check_model_spec
from common.options import ENV_PREFIX, USED_BY, env_name, flag_name, load_config
from common.proxy_addresses import ProxyEntry, parse_proxy_list

__all__ = [
    "EMBEDDED_MODEL_NAME", "ENV_PREFIX", "PROXY_HTTP_PORT", "PROXY_REGISTRY_PORT", "ROLE_HTTP_PORTS",
    "ROLE_KV_PORTS", "NodeConfig", "Role", "check_model_spec", "env_name", "flag_name", "load_config",
    "routable_host",
]

Role = Literal["both", "prefill", "decode"]
ROLE_HTTP_PORTS: dict[str, int] = {"both": 8000, "prefill": 8100, "decode": 8200}
ROLE_KV_PORTS: dict[str, int] = {"both": 14581, "prefill": 14579, "decode": 14580}
# The proxy's defaults live here (not in proxy/) so `pdserve up` needs nothing from the proxy package.
PROXY_HTTP_PORT = 10001
PROXY_REGISTRY_PORT = 30001
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# Options only some commands read: their own TOML table ([serve]...) may not set the others.
DAEMONS = {USED_BY: ("prefill", "decode")}
PREFILL_ONLY = {USED_BY: ("prefill",)}
DECODE_ONLY = {USED_BY: ("decode",)}


def routable_host() -> str | None:
    """The address this host reaches other hosts from (its default route); None if only loopback.

    A UDP ``connect`` picks the source address without sending a packet.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("198.51.100.1", 9))  # TEST-NET-2: never contacted, only routed
            address = sock.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


DEFAULT_LOCAL_PREFILL_STALL_MS = 50.0  # a decode node's bound on a decode step's wait for a local prefill


class HttpServerOptions(BaseModel):
    """How long an HTTP client may take to send a request, and how many may be connected: the
    same bounds on the proxy and on every node (common/serving/http_server.py enforces them)."""

    http_header_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="A client that has not sent a request's headers this long after it "
        "connected (or began the request) gets a 408 and is disconnected"
    )
    http_body_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="A client that has not sent a request's whole body this long after its "
        "headers gets a 408 and is disconnected (a node aborts the request)"
    )
    http_max_connections: int = Field(
        1024, ge=1, le=1_000_000, description="Most open HTTP connections; more are answered 503 and closed "
        "(on a node, keep it above the proxy's --max-idle-connections)"
    )


class NodeConfig(HttpServerOptions, EngineConfig):
    """Everything one serving node (colocated, prefill or decode daemon) is started with: its engine's
    options (inherited from :class:`EngineConfig`, so the engine is handed this object as it is), the
    HTTP bounds, and what the node adds (addresses, the KV endpoint, registration)."""

    model_config = {"extra": "forbid"}

    host: str = Field("127.0.0.1", description="Address the HTTP server binds to")
    port: int | None = Field(
        None, ge=1, le=65535, description="HTTP port (role default: 8000 serve, 8100 prefill, 8200 decode)"
    )
    role: Role = Field("both", description="both = colocated; prefill/decode = disaggregated daemon")
    max_n: int = Field(16, ge=1, le=1024, description="Most choices (the request's n) one request may ask for")
    kv_host: str | None = Field(
        None,
        description="Address other processes use to reach this node (KV endpoint and the address registered "
        "with the proxy); unset = host, or the host's routable address when host is 0.0.0.0",
        json_schema_extra=DAEMONS,
    )
    kv_port: int | None = Field(
        None, ge=1, le=65535, description="KV transfer (ZMQ) port (role default: 14579 prefill, 14580 decode)",
        json_schema_extra=DAEMONS,
    )
    kv_events_port: int | None = Field(
        None, ge=1, le=65534, description="KV events (ZMQ PUB) port, the replay socket at the next one (with "
        "--proxy: the proxies subscribe to the prefix cache's changes there); unset = two free ports, "
        "advertised in the heartbeat. Set it where a firewall must name the ports", json_schema_extra=DAEMONS,
    )
    proxy: str | None = Field(
        None, description="Proxy registries to register and heartbeat with: HOST:PORT, or several separated by "
        "commas (every proxy is active); a DNS name stands for every address it resolves to (a Kubernetes "
        "headless Service); unset = none", json_schema_extra=DAEMONS,
    )
    proxy_resolve_interval_s: float = Field(
        2.0, gt=0, le=3600, description="How often --proxy's DNS names are resolved again: a proxy that appears "
        "is heartbeated from the next resolution, one that is gone no more", json_schema_extra=DAEMONS,
    )
    heartbeat_interval_s: float = Field(
        2.0, gt=0, le=MAX_HEARTBEAT_INTERVAL_S, description="Seconds between heartbeats", json_schema_extra=DAEMONS
    )
    kv_timeout_s: float = Field(
        5.0, gt=0, le=3600,
        description="How long a KV transfer may go without progress (a peer silent this long has failed; "
                    "a slow link that keeps moving is not cut off)", json_schema_extra=DAEMONS
    )
    kv_connect_timeout_s: float = Field(
        60.0, gt=0, le=3600,
        description="How long building a KV data-plane pair may take after the handshake (NCCL's first "
                    "communicator set-up takes seconds)", json_schema_extra=DAEMONS
    )
    kv_lease_s: float = Field(30.0, gt=0, le=86400, description="How long prefill holds KV nobody asked for",
                              json_schema_extra=DAEMONS)
    drain_timeout_s: float = Field(
        30.0, ge=0, le=3600, description="A role flip (POST /admin/role) waits at most this long for the "
        "requests the node holds (prompts, KV awaiting a pull, streams) to finish; then it ends the rest, "
        "which the proxy runs again on other nodes. 0: end them at once", json_schema_extra=DAEMONS)
    accept_unsigned_kv_transfer_params: bool = Field(
        False, description="With a cluster key, serve a request that uses kv_transfer_params though no proxy "
        "signed its id (vLLM Router, llm-d and vLLM's NIXL proxy sign nothing; the params themselves are still "
        "checked, the prefill node signs them). Off: such a request is refused as any unsigned id is (403), so "
        "only what reaches the daemon's port can use it when on", json_schema_extra=DAEMONS,
    )
    kv_peers: str | None = Field(
        None, description="Decode: comma-separated prefill KV addresses (HOST:PORT) this node may pull KV from, "
        "besides the prefill nodes the proxy's registry names; unset and no registry answer (no proxy, or "
        "vLLM's) = any address (keyless: trusted networks only)", json_schema_extra=DECODE_ONLY
    )
    kv_max_pairs: int = Field(
        64, ge=1, le=4096, description="KV data-plane pairs (a thread and sockets each) a prefill node holds "
        "at most; handshakes past it are refused (the decode node then computes the prompt itself), and a pair "
        "with no transfer for 60 s is closed. Keyless, a pair whose decode node the registry does not name keeps "
        "its slot 5 s at most and is the first to give it up to a registered one's",
        json_schema_extra=DAEMONS,
    )
    kv_transport: Literal["auto", "cuda_ipc", "nccl", "tcp", "gloo"] = Field(
        "auto", description="KV data plane, chosen per pair at its handshake; auto = cuda_ipc (CUDA, one "
        "host), nccl (CUDA, two hosts), tcp (CPU)", json_schema_extra=DAEMONS
    )
    kv_checksum: Literal["auto", "on", "off"] = Field(
        "auto", description="CRC-32 of each KV layer, checked by the decode node before it uses the KV (both "
        "sides agree at the handshake: off on either side wins, then on); auto = off on every transport today "
        "(on a CPU it costs ~0.5 ms per MB on each side, 4x a loopback transfer; tcp checksums its segments "
        "anyway; a cuda_ipc pair never checksums: the copy is GPU to GPU). The transfer's nonce and its layer and "
        "byte counts are always checked", json_schema_extra=DAEMONS
    )
    kv_ranks: int | None = Field(
        None, ge=1, le=64,
        description="Prefill: KV ranks this node presents to decode nodes (default: --tensor-parallel-size), at "
        "--kv-port + 0..N-1; a multiple of the TP size that divides the model's KV heads. Set it to the largest "
        "decode TP size to pair with decode nodes of a larger TP size (each rank's heads cut in equal slices)",
        json_schema_extra=PREFILL_ONLY,
    )
    max_unclaimed_kv_share: float = Field(
        0.5, gt=0, le=1, description="Prefill: share of the KV cache held for requests nobody asked for yet",
        json_schema_extra=PREFILL_ONLY,
    )
    cluster_key_file: str | None = Field(
        None, description="Shared secret file (same on proxy and nodes): daemons serve only signed ids"
    )
    insecure_keyless_network: bool = Field(
        False, description="Start without --cluster-key-file on an address other than loopback (--host, "
        "--kv-host): anyone who reaches the node's ports can then send it requests past the proxy's API key, "
        "make it connect anywhere and pull or drop KV. Without it a keyless daemon refuses such an address",
        json_schema_extra=DAEMONS,
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level")
    log_file: str | None = Field(None, description="Also write logs to this file")
    cache_dir: str = Field(
        DEFAULT_CACHE_DIR, description="Where the default model is fetched to, GGUF files are converted and "
        "the embedded model is generated"
    )
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest request body (413 above)")
    keep_alive_timeout_s: float = Field(
        5.0, gt=0, le=3600, description="Idle keep-alive connections close after (the proxy's pool drops them at 4 s)"
    )
    stream_write_timeout_s: float = Field(
        30.0, gt=0, le=3600,
        description="A streamed reply whose client accepted no bytes this long is aborted (blocks freed, "
        "connection reset)"
    )

    @field_validator("cluster_key_file")
    @classmethod
    def _key_file(cls, value: str | None) -> str | None:
        return check_key_file(value)

    @field_validator("proxy")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        return None if value is None else ",".join(str(entry) for entry in parse_proxy_list(value))

    _kv_host_chosen: bool = PrivateAttr(False)  # True when kv_host was picked for a wildcard bind

    @field_validator("model")
    @classmethod
    def _model_spec(cls, value: str | None) -> str | None:
        return None if value is None else check_model_spec(value)

    @model_validator(mode="after")
    def _tensor_parallel_role(self) -> NodeConfig:
        if self.kv_ranks is not None and self.kv_ranks % self.tensor_parallel_size:
            raise ValueError(f"--kv-ranks {self.kv_ranks} must be a multiple of --tensor-parallel-size "
                             f"{self.tensor_parallel_size}: each rank presents the same number of KV ranks")
        return self

    @property
    def kv_rank_count(self) -> int:
        """The KV endpoints this daemon opens (at --kv-port + 0..N-1): --kv-ranks on a prefill node,
        else one per tensor-parallel rank."""
        if self.role == "prefill" and self.kv_ranks is not None:
            return self.kv_ranks
        return self.tensor_parallel_size

    @model_validator(mode="after")
    def _role_defaults(self) -> NodeConfig:
        if self.port is None:
            self.port = ROLE_HTTP_PORTS[self.role]
        if self.kv_port is None:
            self.kv_port = ROLE_KV_PORTS[self.role]
        if self.max_local_prefill_stall_ms is None and self.role == "decode":
            self.max_local_prefill_stall_ms = DEFAULT_LOCAL_PREFILL_STALL_MS  # bounds its local prefills
        if self.kv_host is None and self.host not in WILDCARD_HOSTS:
            self.kv_host = self.host
        elif self.kv_host is None and self.role == "both":
            self.kv_host = "127.0.0.1"  # a colocated node transfers nothing and registers nowhere
        elif self.kv_host is None:
            # Registering 127.0.0.1 would make the node unreachable from any other host.
            self.kv_host = routable_host()
            if self.kv_host is None:
                raise ValueError(f"--host {self.host or '0.0.0.0'} needs --kv-host: this host has no address "
                                 "other than loopback for peers and the proxy to reach it at")
            self._kv_host_chosen = True
        return self

    @property
    def kv_host_chosen(self) -> bool:
        """True when ``kv_host`` was not given and the host's routable address was chosen."""
        return self._kv_host_chosen

    @property
    def proxy_entries(self) -> tuple[ProxyEntry, ...]:
        """``--proxy``'s entries (none when unset)."""
        return parse_proxy_list(self.proxy) if self.proxy else ()

    @property
    def kv_peer_list(self) -> frozenset[str]:
        """``--kv-peers`` as a set of ``host:port``."""
        return frozenset(a.strip() for a in (self.kv_peers or "").split(",") if a.strip())

    @property
    def kv_addr(self) -> str:
        """``host:port`` peers use to reach this node's KV endpoint."""
        return f"{self.kv_host}:{self.kv_port}"
