"""Prefix-aware routing: a prompt follows its prefix, unless loads spread too far apart."""

from __future__ import annotations

import dataclasses

import httpx

from helpers.waiting import wait_for
from proxy.prefix_policy import chunk_hashes, prompt_text
from test_proxy_routing import node, router_with

SYSTEM = "You are a helpful assistant. " * 20  # 580 characters: 9 chunks of 64


def test_prompt_text_of_each_body_shape():
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_text(chat) == "system\x1fbe brief\x1euser\x1fhi\x1e"
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": [1, 2, 3]}) == "1,2,3,"
    assert prompt_text({"prompt": [[4, 5]]}) == "4,5,"
    assert prompt_text({}) == ""
    longer = {"messages": chat["messages"] + [{"role": "assistant", "content": "hello"}]}
    assert prompt_text(longer).startswith(prompt_text(chat))  # a conversation's turns share a prefix


def test_chunk_hashes_name_prefixes():
    a, b = chunk_hashes(SYSTEM + "x" * 100, 64), chunk_hashes(SYSTEM + "y" * 100, 64)
    assert len(a) == 10 and a[:9] == b[:9] and a[9] != b[9]
    assert chunk_hashes("short", 64) == []


def test_a_conversation_follows_its_prefix_and_new_ones_spread():
    r = router_with(node("P", 1), node("P", 2), node("D", 11), node("D", 12), policy="prefix_aware")
    conv_a = SYSTEM + "user: tell me about pandas. " * 5
    first = r.pick("m", prompt=conv_a)
    r.begin(first)
    # another conversation shares only the system prompt with both... and with nobody else yet:
    # the node that has it wins over an empty one while loads are close
    conv_b = SYSTEM + "user: what is a monad? " * 5
    second = r.pick("m", prompt=conv_b)
    assert second.prefill == first.prefill and second.decode == first.decode
    r.begin(second)
    for _ in range(3):  # conversation A's next turns stay where its history is
        turn = r.pick("m", prompt=conv_a + "assistant: pandas is a library. user: and numpy?")
        assert (turn.prefill, turn.decode) == (first.prefill, first.decode)
    r.end(first)
    r.end(second)


def test_a_node_that_left_is_forgotten():
    r = router_with(node("P", 1), node("P", 2), node("D", 11), node("D", 12), policy="prefix_aware")
    home = r.pick("m", prompt=SYSTEM + "question")
    policy = r._prefill_policy
    assert ("P", home.prefill.http_address) in policy._seen
    r.registry.register(dataclasses.replace(home.prefill, goodbye=True))
    after = r.pick("m", prompt=SYSTEM + "question")  # the only other prefill, and nothing kept for the gone one
    assert after.prefill.http_address != home.prefill.http_address
    assert set(policy._seen) == {("P", after.prefill.http_address)}


def test_no_shared_prefix_goes_to_the_least_loaded():
    r = router_with(node("P", 1, num_running=3), node("P", 2), node("D", 11), node("D", 12, num_running=2),
                    policy="prefix_aware")
    pair = r.pick("m", prompt="a" * 200)
    assert pair.prefill.http_address == "127.0.0.1:2" and pair.decode.http_address == "127.0.0.1:11"


def test_load_spread_past_the_threshold_overrides_the_prefix():
    r = router_with(node("P", 1), node("P", 2), node("D", 11), node("D", 12), policy="prefix_aware")
    prompt = SYSTEM + "question"
    home = r.pick("m", prompt=prompt)
    busy = []
    for _ in range(5):  # the home node gets 5 requests in flight, the other none
        r.begin(home)
        busy.append(home)
    elsewhere = r.pick("m", prompt=prompt)
    assert elsewhere.prefill != home.prefill and elsewhere.decode != home.decode
    for pair in busy:
        r.end(pair)
    assert r.pick("m", prompt=prompt).prefill in (home.prefill, elsewhere.prefill)  # both know it now


def test_without_a_prompt_it_is_least_loaded():
    r = router_with(node("P", 1, num_running=1), node("P", 2), node("D", 11), policy="prefix_aware")
    assert r.pick("m").prefill.http_address == "127.0.0.1:2"


def test_proxy_routes_each_conversation_back_to_its_nodes(make_cluster):
    """Over real HTTP (fake nodes): each conversation's later turns reach the nodes of its first."""
    c = make_cluster(n_prefill=2, n_decode=2, policy="prefix_aware")
    for d in c.decodes:
        d.behavior.after = tuple(c.prefills)  # else D may finish first and the P leg be cancelled unseen
    convs = {name: [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"{name}: " + "tell me more about this topic. " * 4}]
             for name in ("a", "b")}
    served: dict[str, set[tuple[int, int]]] = {"a": set(), "b": set()}
    for turn in range(3):
        for name, messages in convs.items():
            before = ([len(n.seen) for n in c.prefills], [len(n.seen) for n in c.decodes])
            r = httpx.post(f"{c.url}/v1/chat/completions", json={"model": "m", "messages": messages,
                                                                   "max_tokens": 2}, timeout=30)
            assert r.status_code == 200, r.text
            assert wait_for(lambda: sum(len(n.seen) for n in c.prefills) > sum(before[0]))
            p = next(i for i, n in enumerate(c.prefills) if len(n.seen) > before[0][i])
            d = next(i for i, n in enumerate(c.decodes) if len(n.seen) > before[1][i])
            served[name].add((p, d))
            messages += [{"role": "assistant", "content": f"answer {turn}"},
                         {"role": "user", "content": "more?"}]
    assert len(served["a"]) == 1 and len(served["b"]) == 1
