"""The proxy's one configuration object (CLI flags > PDSERVE_* env > TOML file)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from common.cluster_auth import check_key_file
from common.registry_client import RegistrationMessage
from common.config import PROXY_HTTP_PORT, PROXY_REGISTRY_PORT, HttpServerOptions
from proxy.planner import PlannerOptions


class ProxyConfig(HttpServerOptions, PlannerOptions):
    """Everything the proxy process reads at start."""

    model_config = {"extra": "forbid"}

    host: str = Field("127.0.0.1", description="Address the OpenAI HTTP server binds.")
    port: int = Field(PROXY_HTTP_PORT, ge=0, le=65535, description="Port of the OpenAI HTTP server.")
    registry_host: str = Field("127.0.0.1", description="Address the ZMQ registration ROUTER binds.")
    registry_port: int = Field(
        PROXY_REGISTRY_PORT, ge=0, le=65535,
        description="Port of the ZMQ registration ROUTER (0 picks a free port).",
    )
    policy: Literal["round_robin", "least_loaded", "prefix_aware"] = Field(
        "round_robin", description="How a prefill node and a decode node are each chosen "
        "(prefix_aware: where the prompt's prefix is likely cached, balanced against load)."
    )
    disagg_policy: Literal["always", "never", "auto"] = Field(
        "auto", description="Where each prompt is prefilled: always on a prefill node, never (the decode node "
        "prefills it itself), or auto: the cheaper path by the nodes' measured prefill rates, queues, the decode "
        "batch a local prefill stalls, the P->D transfer rate and the hand-off's measured cost, local only within "
        "the decode node's --max-local-prefill-stall-ms."
    )
    tokenizer: str | None = Field(
        None, description="A model directory with the nodes' tokenizer (tokenizer.json, tokenizer_config.json): "
        "the proxy then names a prompt's blocks as the nodes do and, from the nodes' KV events, prefix_aware and "
        "--disagg-policy auto count each node's cached prefix exactly (without it: token-id prompts only; text "
        "prompts keep the text estimate)."
    )
    kv_index_max_blocks: int = Field(
        1_000_000, ge=1, le=100_000_000, description="Most block hashes the KV event index keeps (~160 bytes "
        "each; the least recently used go first)."
    )
    dispatch: Literal["concurrent", "prefill_first"] = Field(
        "concurrent",
        description="Send both legs at once, or wait for the prefill leg first (vLLM's order).",
    )
    heartbeat_timeout_s: float = Field(
        6.0, gt=0, description="A node silent this long is evicted (about three 2 s heartbeats)."
    )
    sweep_interval_s: float = Field(1.0, gt=0, description="How often silent nodes are looked for.")
    static_prefill: list[str] = Field(
        default_factory=list,
        description="Prefill nodes that need no registration: "
        "'HTTP_HOST:PORT@KV_HOST:PORT[@MODEL[@FINGERPRINT]]'.",
    )
    static_decode: list[str] = Field(
        default_factory=list,
        description="Decode nodes that need no registration, same format as static_prefill.",
    )
    api_key: str | None = Field(
        None, description="If set, clients must send 'Authorization: Bearer KEY' to the OpenAI routes and /metrics."
    )
    cache_salt_from_api_key: bool = Field(
        False, description="Set every request's cache_salt from the client's API key (an HMAC of its bearer "
        "token; a client's own cache_salt is overridden), so clients with different keys share no cached "
        "prefix and cannot time each other's prompts."
    )
    cluster_key_file: str | None = Field(
        None, description="Shared secret file (same on every node): signs ids, authenticates registration."
    )
    insecure_keyless_network: bool = Field(
        False, description="Start without --cluster-key-file on an address other than loopback (--host, "
        "--registry-host): anyone who reaches the registry can then register nodes and get clients' prompts. "
        "Without it a keyless proxy refuses such an address."
    )
    max_nodes: int = Field(1024, ge=1, le=1_000_000, description="Most nodes the registry holds.")
    connect_timeout_s: float = Field(5.0, gt=0, description="Opening a connection to a node.")
    prefill_timeout_s: float = Field(300.0, gt=0, description="The whole prefill leg, queueing included.")
    node_stall_timeout_s: float = Field(
        60.0, gt=0, description="A node whose heartbeats say its engine has been stuck in one step this long "
        "(a hung kernel, a deadlock) fails the legs it holds with a 504 and gets no new requests."
    )
    unreachable_cooldown_s: float = Field(
        10.0, ge=0, le=3600, description="A node a leg could not reach (connection refused or reset, connect "
        "timeout) gets no new request another node can take for this long, before its heartbeats time out; "
        "0 turns it off."
    )
    first_token_timeout_s: float = Field(
        300.0, gt=0, description="From dispatch to the decode node's first bytes."
    )
    total_timeout_s: float = Field(3600.0, gt=0, description="A whole request, stream included.")
    migration_limit: int = Field(
        2, ge=0, le=100, description="A stream whose decode node dies or stalls after it began goes on from "
        "another decode node (the tokens sent so far resent as ids) at most this many times; 0 turns it off."
    )
    max_idle_connections: int = Field(256, gt=0, description="Keep-alive connections kept open to each node.")
    stream_idle_timeout_s: float = Field(
        30.0, gt=0, description="A stream that relayed nothing this long is ended (SSE error + [DONE]) and "
        "both legs are cancelled."
    )
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest request body (413 above).")
    keep_alive_timeout_s: float = Field(
        20.0, gt=0, le=3600, description="Idle client connections are closed after this many seconds: longer "
        "than clients keep an idle connection (httpx and the openai client 5 s, aiohttp 15 s), so that none "
        "sends a request on a connection the proxy is closing (\"Server disconnected without sending a response\")."
    )
    stream_write_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="A client that accepted no bytes of a stream this long is cut off "
        "(connection reset) and both legs are cancelled."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    log_file: str | None = Field(None, description="Also write logs to this file.")

    @field_validator("cluster_key_file")
    @classmethod
    def _key_file(cls, value: str | None) -> str | None:
        return check_key_file(value)

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_dir(cls, value: str | None) -> str | None:
        if value and not (Path(value).expanduser() / "tokenizer.json").is_file():
            raise ValueError(f"{value} holds no tokenizer.json: give the model directory the nodes load")
        return str(Path(value).expanduser()) if value else value

    @field_validator("static_prefill", "static_decode")
    @classmethod
    def _check_entries(cls, value: list[str]) -> list[str]:
        for entry in value:
            parse_static_node(entry, "P")
        return value

    def static_nodes(self) -> list[RegistrationMessage]:
        """The static node lists as registration messages."""
        return [parse_static_node(e, "P") for e in self.static_prefill] + [
            parse_static_node(e, "D") for e in self.static_decode
        ]


def parse_static_node(entry: str, node_type: str) -> RegistrationMessage:
    """'HTTP_HOST:PORT@KV_HOST:PORT[@MODEL[@FINGERPRINT]]' -> a registration message."""
    parts = [p.strip() for p in entry.split("@")]
    if not 2 <= len(parts) <= 4 or not all(_is_host_port(p) for p in parts[:2]):
        raise ValueError(
            f"static node {entry!r}: expected 'HTTP_HOST:PORT@KV_HOST:PORT[@MODEL[@FINGERPRINT]]'"
        )
    model = parts[2] if len(parts) > 2 and parts[2] else None
    fingerprint = parts[3] if len(parts) > 3 and parts[3] else None
    return RegistrationMessage(
        type=node_type, http_address=parts[0], zmq_address=parts[1], model=model, kv_fingerprint=fingerprint
    )


def _is_host_port(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit()
