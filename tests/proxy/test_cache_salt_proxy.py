"""``cache_salt`` at the proxy: prefix-aware routing keys chunks by salt, and
``--cache-salt-from-api-key`` gives each API key its own salt on both legs."""

from __future__ import annotations

import httpx

from common.cluster_auth import ClusterKey
from helpers.waiting import wait_for
from proxy.cache_salt import TenantSalt
from proxy.prefix_policy import chunk_hashes, prompt_text
from test_proxy_routing import node, router_with

SYSTEM = "You are a helpful assistant. " * 20  # 580 characters: 9 chunks of 64


def test_chunks_are_named_per_salt():
    plain = chunk_hashes(prompt_text({"prompt": SYSTEM}), 64)
    a = chunk_hashes(prompt_text({"prompt": SYSTEM, "cache_salt": "a"}), 64)
    assert len(a) == len(plain) == 9 and prompt_text({"prompt": SYSTEM, "cache_salt": "a"}) == SYSTEM
    assert a == chunk_hashes(prompt_text({"prompt": SYSTEM, "cache_salt": "a"}), 64)
    assert not set(a) & set(plain)
    assert not set(a) & set(chunk_hashes(prompt_text({"prompt": SYSTEM, "cache_salt": "b"}), 64))


def test_a_prefix_is_followed_only_within_its_salt():
    r = router_with(node("P", 1), node("P", 2), node("D", 11), node("D", 12), policy="prefix_aware")
    tenant_a = prompt_text({"prompt": SYSTEM + "question", "cache_salt": "a"})
    home = r.pick("m", prompt=tenant_a)
    r.begin(home)  # the home pair is busier by one: only a shared prefix draws a request there
    assert r.pick("m", prompt=tenant_a).prefill == home.prefill
    tenant_b = prompt_text({"prompt": SYSTEM + "question", "cache_salt": "b"})
    assert r.pick("m", prompt=tenant_b).prefill != home.prefill  # b's cache holds nothing of a's
    r.end(home)


def test_the_salt_of_an_api_key():
    tenants = TenantSalt(ClusterKey(b"k" * 32))
    a, b = tenants.salt("Bearer key-a"), tenants.salt("Bearer key-b")
    assert a == tenants.salt("bearer  key-a ") and a != b and len(a) == 64
    assert tenants.salt(None) == tenants.salt("") != a  # no key: one anonymous tenant
    assert TenantSalt(ClusterKey(b"k" * 32)).salt("Bearer key-a") == a  # one cluster key, one salt per key
    assert TenantSalt().salt("Bearer key-a") != a  # without a cluster key the secret is the process's own
    assert tenants.apply({"prompt": "x", "cache_salt": "guess"}, "Bearer key-b")["cache_salt"] == b


def test_the_proxy_sets_the_salt_on_both_legs(make_cluster):
    c = make_cluster(cache_salt_from_api_key=True)
    c.decodes[0].behavior.after = tuple(c.prefills)  # the prefill leg must arrive before D answers

    def send(key: str, **extra) -> dict:
        n = len(c.decodes[0].seen)
        reply = httpx.post(f"{c.url}/v1/completions", json={"model": "m", "prompt": SYSTEM, **extra},
                           headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert reply.status_code == 200, reply.text
        assert wait_for(lambda: len(c.prefills[0].seen) > n)
        p, d = c.prefills[0].seen[n].body, c.decodes[0].seen[n].body
        assert p["cache_salt"] == d["cache_salt"] and p["prompt"] == d["prompt"] == SYSTEM
        return d

    a = send("key-a")["cache_salt"]
    assert send("key-a", cache_salt="mine")["cache_salt"] == a  # a client's own salt is overridden
    b = send("key-b", cache_salt=a)["cache_salt"]  # even one copied from another tenant
    assert b != a and a not in ("key-a", "mine")
    assert send("key-a", stream=True)["stream"] is True


def test_without_the_option_a_client_salt_passes_through(make_cluster):
    c = make_cluster()
    reply = httpx.post(f"{c.url}/v1/completions", json={"model": "m", "prompt": "hi", "cache_salt": "s1"},
                       timeout=30)
    assert reply.status_code == 200, reply.text
    assert c.decodes[0].seen[-1].body["cache_salt"] == "s1"
