"""The peer tier's proxy side (``--kv-peer-fetch``, issue 35): the registry names a peer fetcher its
peers; the leg that computes a prompt carries ``pdserve_peer_prefix`` when another peer fetcher's
pool holds more of the prompt's prefix (and only then); a client's own such field never reaches a
node; routing counts a peer fetcher's reach at its measured PEER worth."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import msgpack
import pytest
from proxy_fakes import FakeNode, ServerThread, stop_servers

from common.engine.block_hash import extend_hashes, salted_root
from common.registry_client import RegistrationMessage, decode_members, decode_peers, encode
from helpers.waiting import wait_for
from helpers.zmq_peer import raw_dealer
from proxy.app import build_app
from proxy.config import ProxyConfig
from proxy.exact_prefix import PEER_PREFIX_FIELD, ExactPrefix, PeerHint
from proxy.kv_index import KVIndex
from proxy.prefix_policy import PromptText
from proxy.registry import ServiceRegistry
from proxy.routing import Router

ROOT = b"r" * 16
TOKENS = list(range(100, 126))  # 6 full blocks of 4, and 2 tokens more


def peer(node_type: str, port: int, fetch: bool | None = True, root: bytes = ROOT, http: str | None = None,
         **fields) -> RegistrationMessage:
    """A node at 127.0.0.1 (KV endpoint ``port``, HTTP ``port + 1000`` unless ``http``), block size 4."""
    return RegistrationMessage(**{
        "type": node_type, "http_address": http or f"127.0.0.1:{port + 1000}", "zmq_address": f"127.0.0.1:{port}",
        "model": "m", "kv_fingerprint": "f", "block_size": 4, "kv_peer_fetch": fetch,
        "kv_events": {"endpoint": "127.0.0.1:1", "replay": "127.0.0.1:2", "epoch": "ab" * 8, "seq": 0,
                      "root": root.hex()}, **fields})


def key(node: RegistrationMessage) -> tuple[str, str]:
    return (node.type, node.http_address)


def chain(tokens: list[int] = TOKENS, root: bytes = ROOT) -> list[bytes]:
    out: list[bytes] = []
    extend_hashes(out, salted_root(root, None), lambda s, e: tokens[s:e], 4, len(tokens) // 4)
    return out


def prompt(salt: str | None = None) -> PromptText:
    return PromptText("text", salt, TOKENS)


def setup(*nodes: RegistrationMessage) -> tuple[ServiceRegistry, KVIndex, ExactPrefix]:
    """A registry holding ``nodes`` and an index where each is fresh and holds nothing yet."""
    registry, index = ServiceRegistry(port=0), KVIndex()
    for node in nodes:
        registry.register(node)
        index.set_fresh(key(node), True)
    return registry, index, ExactPrefix(index, registry.peer_fetchers)


# ---- the hint's decision ---------------------------------------------------------------------------
def test_the_hint_names_the_holder_of_the_most_pool_blocks_the_least_loaded_on_a_tie() -> None:
    target, far, busy, idle = (peer("P", 14001), peer("D", 14002), peer("D", 14003, num_running=4),
                               peer("D", 14004, num_running=1))
    registry, index, exact = setup(target, far, busy, idle)
    hashes = chain()
    index.stored(key(far), hashes[:3])
    index.stored(key(busy), hashes[:5])
    index.stored(key(idle), hashes[:5])
    index.stored(key(target), hashes[:1])
    index.tier("DISK").stored(key(target), hashes[1:2])  # pool and tiers: a run of 2
    assert exact.peer_hint(target, prompt()) == PeerHint("127.0.0.1:14004", 5)
    assert exact.peer_hint(target, prompt()).field() == {"kv_addr": "127.0.0.1:14004", "blocks": 5}
    index.tier("CPU").stored(key(target), hashes[2:5])  # its own run now reaches as far: nothing to fetch
    assert exact.peer_hint(target, prompt()) is None
    index.stored(key(idle), hashes[5:6])  # all 6 blocks: one more than the target's run
    assert exact.peer_hint(target, prompt()) == PeerHint("127.0.0.1:14004", 6)
    assert list(prompt().chains) == []  # a new prompt's hashes are made when first asked ...
    asked = prompt()
    exact.peer_hint(target, asked)
    assert list(asked.chains) == [(ROOT.hex(), 4)]  # ... once, then read by every later question


def test_no_hint_unless_both_run_peer_fetch_with_fresh_events_on_one_chain() -> None:
    target, holder = peer("D", 14001), peer("P", 14002)
    registry, index, exact = setup(target, holder, peer("P", 14003, fetch=None), peer("P", 14004, model="other"),
                                   peer("P", 14005, root=b"x" * 16), peer("P", 14006, tp_size=2))
    for node in registry.nodes("P"):  # each holds the whole prompt, named on its own chain
        index.stored(key(node.info), chain(root=bytes.fromhex(node.info.kv_events.root)))
    assert exact.peer_hint(target, prompt()) == PeerHint("127.0.0.1:14002", 6)  # the one peer it may fetch from
    assert exact.peer_hint(peer("D", 14001, fetch=False), prompt()) is None  # the target does not fetch
    assert exact.peer_hint(target, prompt("tenant")) is None  # another salt: another chain, held by none
    assert exact.peer_hint(target, "text without token ids") is None
    index.set_fresh(key(target), False)  # what the target holds is unknown: no hint
    assert exact.peer_hint(target, prompt()) is None
    index.set_fresh(key(target), True)
    index.set_fresh(key(holder), False)  # the holder's events went stale: it counts as holding nothing
    assert exact.peer_hint(target, prompt()) is None
    index.set_fresh(key(holder), True)
    registry.register(peer("P", 14002, fetch=False))  # restarted without --kv-peer-fetch
    assert exact.peer_hint(target, prompt()) is None
    registry.register(peer("P", 14002, role_state="draining"))  # routable nodes only
    assert exact.peer_hint(target, prompt()) is None


def test_routing_counts_a_peer_fetchers_reach_at_its_peer_worth() -> None:
    """1,000 prefill tokens/s and 1,000 bytes of KV a token: a peer fetch at 10 MB/s loads a token in
    0.1 ms, worth 0.9 of computing it. The fetcher holding 1 block counts it, then the 3 more the
    best holder has at 0.9 each; a node that does not fetch counts only its own."""
    figures = {"prefill_tokens_per_s": 1000.0, "kv_bytes_per_token": 1000.0}
    fetcher = peer("D", 14001, kv_tier_load_bytes_per_s={"PEER": 1e7}, **figures)
    plain = peer("D", 14002, fetch=None, **figures)
    holder = peer("P", 14003)
    registry, index, exact = setup(fetcher, plain, holder)
    hashes = chain()
    index.stored(key(holder), hashes[:4])
    index.stored(key(fetcher), hashes[:1])
    index.stored(key(plain), hashes[:2])
    assert exact.cached_tokens([fetcher, plain], prompt()) == {key(fetcher): 4 + round(3 * 0.9 * 4), key(plain): 8}
    router = Router(registry, "prefix_aware", exact=exact)
    assert router.pick("m", prompt=prompt()).decode == fetcher
    unmeasured = peer("D", 14001, **figures)  # no PEER rate yet: its reach counts nothing
    assert exact.cached_tokens([unmeasured], prompt()) == {key(unmeasured): 4}


# ---- the registry's answer -------------------------------------------------------------------------
@pytest.fixture
def registry() -> Iterator[ServiceRegistry]:
    reg = ServiceRegistry(port=0)
    reg.start()
    try:
        yield reg
    finally:
        reg.stop()


def test_the_registry_names_a_peer_fetcher_its_peers(registry: ServiceRegistry) -> None:
    for node in (peer("P", 14011), peer("D", 14012), peer("P", 14013, model="other"), peer("D", 14014, fetch=None),
                 peer("P", 14015, tp_size=2)):
        registry.register(node)
    with raw_dealer(registry.address) as asker, raw_dealer(registry.address) as plain:
        asker.send(encode(peer("D", 14010, heartbeat_interval_s=30.0)))
        assert asker.poll(10_000)
        answer = asker.recv()
        assert decode_peers(answer) == {"127.0.0.1:14011", "127.0.0.1:14012"}  # not itself, other models, TP 2
        assert decode_members(answer) == {"127.0.0.1:14011", "127.0.0.1:14015"}  # pairing is as before
        plain.send(encode(peer("D", 14016, fetch=None)))
        assert plain.poll(10_000) and msgpack.unpackb(plain.recv())["peers"] == []  # it fetches from no one
        with raw_dealer(registry.address) as joining:  # a peer fetcher that joins is named to it at once
            joining.send(encode(peer("D", 14017)))
            assert asker.poll(10_000) and decode_peers(asker.recv()) == {
                "127.0.0.1:14011", "127.0.0.1:14012", "127.0.0.1:14017"}


# ---- through the proxy -----------------------------------------------------------------------------
@dataclass
class Proxy:
    server: ServerThread
    app: object
    prefill: FakeNode
    decode: FakeNode
    p: RegistrationMessage
    d: RegistrationMessage
    index: KVIndex


@pytest.fixture(scope="module")
def proxies() -> Iterator[dict[str, Proxy]]:
    """Two proxies, each with a fake prefill and decode node running --kv-peer-fetch: one prefills
    remotely (``always``, prefix-aware), one on the decode node (``never``, round robin). Their index
    is the test's own: what the nodes hold is set by each test as their KV events would."""
    servers: list[ServerThread] = []

    def serve(app) -> ServerThread:
        servers.append(server := ServerThread(app))
        return server.start()

    out = {}
    try:
        for n, mode in enumerate(("always", "never")):
            prefill, decode = FakeNode("P", f"p-{mode}"), FakeNode("D", f"d-{mode}")
            p = peer("P", 14100 + 2 * n, http=serve(prefill.app).address)
            d = peer("D", 14101 + 2 * n, http=serve(decode.app).address)
            if mode == "always":
                decode.behavior.after = (prefill,)  # a real decode node answers only after its prefill
            registry = ServiceRegistry(port=0, static_nodes=[p, d])
            # the local one routes by round robin: the hint needs no policy that reads prefixes
            policy = "prefix_aware" if mode == "always" else "round_robin"
            app = build_app(ProxyConfig(port=0, registry_port=0, policy=policy, disagg_policy=mode), registry)
            server = serve(app)
            index = KVIndex()
            for node in (p, d):
                index.set_fresh(key(node), True)
            app.state.dispatcher.exact = ExactPrefix(index, registry.peer_fetchers)
            out[mode] = Proxy(server, app, prefill, decode, p, d, index)
        yield out
    finally:
        stop_servers(servers)


def send(proxy: Proxy, **extra) -> tuple[dict | None, dict]:
    """One request with the prompt's token ids; the bodies the prefill node (None: no leg) and the
    decode node got."""
    seen_p, seen_d = len(proxy.prefill.seen), len(proxy.decode.seen)
    reply = httpx.post(f"{proxy.server.url}/v1/completions", json={"model": "m", "prompt": TOKENS, **extra},
                       timeout=30)
    assert reply.status_code == 200, reply.text
    assert wait_for(lambda: len(proxy.decode.seen) > seen_d)
    p = proxy.prefill.seen[seen_p].body if len(proxy.prefill.seen) > seen_p else None
    return p, proxy.decode.seen[seen_d].body


def hints(proxy: Proxy) -> float:
    text = httpx.get(f"{proxy.server.url}/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith("pdserve:proxy_peer_hints_total"))
    return float(line.split()[-1])


HOSTILE = {PEER_PREFIX_FIELD: {"kv_addr": "10.9.9.9:1", "blocks": 99}}


def test_the_prefill_leg_carries_the_hint_and_the_decode_leg_none(proxies: dict[str, Proxy]) -> None:
    x = proxies["always"]
    x.index.cleared(key(x.p))
    x.index.stored(key(x.d), chain()[:3])
    before = hints(x)
    p, d = send(x, **HOSTILE)
    assert p[PEER_PREFIX_FIELD] == {"kv_addr": x.d.zmq_address, "blocks": 3}  # the proxy's, not the client's
    assert PEER_PREFIX_FIELD not in d and p["prompt"] == d["prompt"] == TOKENS
    assert hints(x) == before + 1
    x.index.stored(key(x.p), chain()[:3])  # it holds as much itself: no hint, and the client's is gone
    p, d = send(x, stream=True, **HOSTILE)
    assert PEER_PREFIX_FIELD not in p and PEER_PREFIX_FIELD not in d and hints(x) == before + 1


def test_a_local_prefill_hints_the_decode_leg(proxies: dict[str, Proxy]) -> None:
    x = proxies["never"]
    x.index.stored(key(x.p), chain()[:6])
    x.index.stored(key(x.d), chain()[:1])
    p, d = send(x, **HOSTILE)
    assert p is None and d[PEER_PREFIX_FIELD] == {"kv_addr": x.p.zmq_address, "blocks": 6}
    x.index.set_fresh(key(x.p), False)  # the holder's events went stale
    p, d = send(x, **HOSTILE)
    assert PEER_PREFIX_FIELD not in d


def test_the_hint_is_spliced_into_the_body_it_joins() -> None:
    import json

    from proxy.body import with_field

    for raw in (b'{"prompt":[1,2]}', b'{ "prompt": [1, 2] }\n', b"{}", '{"prompt":"\u00e9"}'.encode("utf-16")):
        out = with_field(raw, PEER_PREFIX_FIELD, {"kv_addr": "h:1", "blocks": 2})
        assert json.loads(out) == {**json.loads(raw), PEER_PREFIX_FIELD: {"kv_addr": "h:1", "blocks": 2}}


def test_a_holders_host_then_file_tier_runs_after_its_pool_count_as_what_it_can_serve() -> None:
    target, holder = peer("P", 14101), peer("D", 14102)
    _, index, exact = setup(target, holder)
    hashes = chain()
    index.stored(key(holder), hashes[:2])
    index.stored(key(target), hashes[:2])
    assert exact.peer_hint(target, prompt()) is None  # the same pool run: nothing to fetch
    index.tier("CPU").stored(key(holder), hashes[2:4])  # evicted to its host tier: a peer serves it too
    assert exact.peer_hint(target, prompt()) == PeerHint("127.0.0.1:14102", 4)
    index.tier("DISK").stored(key(holder), hashes[5:6])  # its file tier, after a hole: not part of the run
    assert exact.peer_hint(target, prompt()) == PeerHint("127.0.0.1:14102", 4)
    index.tier("DISK").stored(key(holder), hashes[4:5])  # the hole filled: pool, host, then files
    assert exact.peer_hint(target, prompt()) == PeerHint("127.0.0.1:14102", 6)
