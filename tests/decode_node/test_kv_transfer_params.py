"""The ``kv_transfer_params`` protocol (vLLM's NIXL proxy, vLLM Router, llm-d) on real daemons.

A router written here speaks only that protocol: the prefill node gets the request with
``do_remote_decode: true``, ``max_tokens`` 1, ``stream`` false and an untagged ``X-Request-Id``; its
reply's ``kv_transfer_params`` (plus ``do_remote_prefill: true``) go to the decode node with the
original request. Prefill and decode nodes are picked independently, round-robin over two of
each, with a cluster key as ``pdserve up`` has (the router holds none: the prefill node signs the
params), and no proxy (decode nodes list the prefill nodes in ``--kv-peers``). Answers equal a
colocated node's; forged, expired and reused params are refused with a 4xx naming why; a prefill
node killed before the pull gives the decode request an error, not a hang.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from common.cluster_auth import ClusterKey
from helpers.cluster import Proc, metric, start, stop_all, wait_idle
from helpers.waiting import wait_until

ENGINE_ARGS = ("--block-size", "16", "--log-level", "info")
OPEN = ("--accept-unsigned-kv-transfer-params",)  # the routers sign nothing
PREFILL_ASK = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("kv_params")
    key = str(ClusterKey.generate(tmp / "cluster.key"))
    procs: dict[str, Proc] = {}
    try:
        procs["both"] = start("both", tmp, *ENGINE_ARGS, wait=False)
        for name in ("p0", "p1"):
            procs[name] = start("prefill", tmp, *ENGINE_ARGS, "--cluster-key-file", key, *OPEN, name=name, wait=False)
        peers = ",".join(procs[p].kv_addr for p in ("p0", "p1"))
        for name in ("d0", "d1"):
            procs[name] = start("decode", tmp, *ENGINE_ARGS, "--cluster-key-file", key, *OPEN, "--kv-peers", peers,
                                name=name, wait=False)
        for proc in procs.values():
            proc.wait_ready()
        yield {"tmp": tmp, "key": key, **procs}
    finally:
        stop_all(procs.values())


def prefill(p: Proc, path: str, body: dict, timeout: float = 60) -> dict:
    """The prefill leg as the router sends it; the reply's kv_transfer_params."""
    leg = {k: v for k, v in body.items() if k != "stream_options"}
    leg.update(kv_transfer_params=PREFILL_ASK, max_tokens=1, stream=False)
    r = httpx.post(p.url + path, json=leg, headers={"X-Request-Id": uuid.uuid4().hex}, timeout=timeout)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["remote_port"] == p.kv_port and params["signature"]
    return params


def decode(d: Proc, path: str, body: dict, params: dict, timeout: float = 60) -> httpx.Response:
    """The decode leg, not streamed: the original request with the prefill node's params."""
    leg = {**body, "kv_transfer_params": {**params, "do_remote_prefill": True}}
    return httpx.post(d.url + path, json=leg, headers={"X-Request-Id": uuid.uuid4().hex}, timeout=timeout)


def answer(reply: dict) -> tuple:
    """What must be equal: each choice's text (or message), logprobs and finish, and the usage."""
    choices = [(c.get("text"), c.get("message"), c.get("logprobs"), c["finish_reason"]) for c in reply["choices"]]
    usage = reply["usage"]
    return choices, usage["prompt_tokens"], usage["completion_tokens"]


def streamed(d: Proc, path: str, body: dict, params: dict) -> tuple[str, list[str], int]:
    """(text, finish reasons, completion tokens) of the decode leg streamed."""
    leg = {**body, "stream": True, "stream_options": {"include_usage": True},
           "kv_transfer_params": {**params, "do_remote_prefill": True}}
    text, finishes, usage = "", [], None
    with httpx.stream("POST", d.url + path, json=leg, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if choice.get("finish_reason"):
                    finishes.append(choice["finish_reason"])
    assert usage is not None
    return text, finishes, usage["completion_tokens"]


def colocated(cluster: dict, path: str, body: dict) -> dict:
    r = httpx.post(cluster["both"].url + path, json={**body, "stream": False}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def text_of(reply: dict) -> str:
    return "".join(c.get("text") or c["message"]["content"] or "" for c in reply["choices"])


BODIES = {
    "completions-greedy": (COMPLETIONS, {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
                                         "ignore_eos": True, "logprobs": 2}),
    "completions-seeded": (COMPLETIONS, {"prompt": "Once upon a time " * 6, "max_tokens": 16, "temperature": 0.9,
                                         "top_p": 0.9, "seed": 11, "ignore_eos": True}),
    "chat-greedy": (CHAT, {"messages": [{"role": "user", "content": "Say something about blocks."}],
                           "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    "chat-seeded": (CHAT, {"messages": [{"role": "user", "content": "Tell me a story " * 5}], "max_tokens": 14,
                           "temperature": 1.0, "seed": 5}),
}


def test_router_of_kv_transfer_params_answers_as_a_colocated_node(cluster: dict) -> None:
    """Every (prefill, decode) combination, each body streamed and not: the colocated answer."""
    i = 0
    for name, (path, body) in BODIES.items():
        expected = colocated(cluster, path, body)
        for stream in (False, True):
            p, d = cluster[f"p{i % 2}"], cluster[f"d{(i // 2) % 2}"]  # independent: all four pairs
            i += 1
            params = prefill(p, path, body)
            if stream:
                got = streamed(d, path, body, params)
                finishes = [c["finish_reason"] for c in expected["choices"]]
                assert got == (text_of(expected), finishes, expected["usage"]["completion_tokens"]), name
                continue
            r = decode(d, path, body, params)
            assert r.status_code == 200, r.text
            assert answer(r.json()) == answer(expected), name
            assert "kv_transfer_params" not in r.json()
    for name in ("p0", "p1", "d0", "d1"):  # every lease released: nothing held
        wait_idle(cluster[name].url)
    for name in ("p0", "p1"):  # the KV moved over the data plane, counted as for tagged ids
        assert metric(cluster[name].url, "pdserve:kv_transfer_bytes_total") > 0
    assert metric(cluster["p0"].url, "pdserve:kv_leases_expired_total") == 0


def aborted(node: Proc) -> float:
    """``pdserve:request_errors_total{kind="aborted"}``: requests whose client left."""
    text = httpx.get(node.url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve:request_errors_total{") and 'kind="aborted"' in line)


def test_a_client_that_leaves_mid_stream_frees_both_nodes(cluster: dict) -> None:
    path, body = COMPLETIONS, {"prompt": "a long answer", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    params = prefill(cluster["p1"], path, body)
    leg = {**body, "stream": True, "kv_transfer_params": {**params, "do_remote_prefill": True}}
    with httpx.stream("POST", cluster["d1"].url + path, json=leg, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))  # tokens are flowing; then hang up
    wait_until(lambda: aborted(cluster["d1"]) == 1, "the decode node aborted the request")
    wait_idle(cluster["d1"].url)
    wait_idle(cluster["p1"].url)


def test_forged_and_malformed_params_are_refused(cluster: dict) -> None:
    path, body = BODIES["completions-greedy"]
    params = prefill(cluster["p0"], path, body)
    for field, value in (("first_token", (params["first_token"] + 1) % 200), ("remote_port", cluster["p1"].kv_port),
                         ("signature", "v1." + "0" * 64), ("expires_at", params["expires_at"] + 3600)):
        r = decode(cluster["d0"], path, body, {**params, field: value})
        assert r.status_code == 403, (field, r.text)
        assert r.json()["error"]["code"] == "kv_transfer_params_forged"
    r = decode(cluster["d0"], path, body, {**params, "remote_port": "14579"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    assert "remote_port" in r.json()["error"]["message"]
    r = decode(cluster["d0"], path, {**body, "prompt": "another prompt"}, params)
    assert r.status_code == 400 and r.json()["error"]["code"] == "kv_transfer_params_invalid", r.text
    # an unsigned request without params is still refused (the key keeps the daemons the proxy's)
    r = httpx.post(cluster["d0"].url + path, json=body, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "unsigned_request_id"
    # the untouched params still work: nothing above spent them
    r = decode(cluster["d0"], path, body, params)
    assert r.status_code == 200, r.text


def test_reused_params_are_refused_on_either_decode_node(cluster: dict) -> None:
    path, body = BODIES["completions-greedy"]
    params = prefill(cluster["p1"], path, body)
    assert decode(cluster["d0"], path, body, params).status_code == 200
    for d in ("d0", "d1"):  # d0 remembers; d1 hears it from the prefill node
        for stream in (False, True):  # a stream's reply starts with its first token: a 409 too
            r = decode(cluster[d], path, {**body, "stream": stream}, params)
            assert r.status_code == 409, (d, stream, r.text)
            assert r.json()["error"]["code"] == "kv_already_pulled"
    wait_idle(cluster["d1"].url)


def test_a_request_the_decode_node_refuses_drops_the_prefill_nodes_kv(cluster: dict) -> None:
    """As for a tagged id: verified params whose request is refused here (too long for this node)
    free the prefill node's blocks now, not at the end of its 30 s lease."""
    path, body = BODIES["completions-greedy"]
    params = prefill(cluster["p0"], path, body)
    assert metric(cluster["p0"].url, "pdserve:kv_cache_usage_perc") > 0  # held for the pull
    r = decode(cluster["d1"], path, {**body, "max_tokens": 10**6}, params)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    wait_idle(cluster["p0"].url, timeout=15)


def test_with_a_key_unsigned_params_need_the_flag(cluster: dict) -> None:
    """Without --accept-unsigned-kv-transfer-params a keyed daemon serves only ids its proxy signed."""
    p = start("prefill", cluster["tmp"], *ENGINE_ARGS, "--cluster-key-file", cluster["key"], name="p-closed")
    try:
        path, body = BODIES["chat-greedy"]
        leg = {**body, "kv_transfer_params": PREFILL_ASK, "max_tokens": 1, "stream": False}
        r = httpx.post(p.url + path, json=leg, headers={"X-Request-Id": uuid.uuid4().hex}, timeout=60)
        assert r.status_code == 403 and r.json()["error"]["code"] == "unsigned_request_id", r.text
        assert metric(p.url, "pdserve:num_requests_running") == 0
    finally:
        stop_all([p])


def test_expired_params_are_refused(cluster: dict) -> None:
    tmp, key = cluster["tmp"], cluster["key"]
    p = start("prefill", tmp, *ENGINE_ARGS, "--cluster-key-file", key, *OPEN, "--kv-lease-s", "1", name="p-short-lease")
    try:
        path, body = BODIES["chat-greedy"]
        params = prefill(p, path, body)
        wait_until(lambda: metric(p.url, "pdserve:kv_leases_expired_total") >= 1, "the lease expired")
        r = decode(cluster["d1"], path, body, params)
        assert r.status_code == 410, r.text
        assert r.json()["error"]["code"] == "kv_expired"
        wait_idle(p.url)
    finally:
        stop_all([p])


def test_prefill_node_killed_before_the_pull(cluster: dict) -> None:
    """The decode request fails with an error naming the transfer, before the lease would end."""
    tmp, key = cluster["tmp"], cluster["key"]
    lease_s = 30.0
    p = start("prefill", tmp, *ENGINE_ARGS, "--cluster-key-file", key, *OPEN, "--kv-lease-s", str(lease_s), name="p-killed")
    try:
        path, body = BODIES["completions-greedy"]
        params = prefill(p, path, body)
        p.kill()
        r = decode(cluster["d0"], path, body, params, timeout=lease_s)
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "kv_transfer_failed"
        wait_idle(cluster["d0"].url)
    finally:
        stop_all([p])


def test_tensor_parallel_daemons_of_one_size_and_a_clear_400_otherwise(cluster: dict) -> None:
    """A prefill node of 2 KV ranks and a decode node of TP 2: each rank pulls its peer's same rank,
    as under a tag; a decode node of TP 1 refuses those params with a 400 naming why."""
    tmp, key = cluster["tmp"], cluster["key"]
    tp = ("--tensor-parallel-size", "2", "--cluster-key-file", key, *OPEN, *ENGINE_ARGS)
    procs = {"p": start("prefill", tmp, *tp, name="p-tp2", wait=False),
             "d": start("decode", tmp, *tp, name="d-tp2", wait=False)}
    try:
        for proc in procs.values():
            proc.wait_ready()
        path, body = BODIES["completions-greedy"]
        params = prefill(procs["p"], path, body)
        assert params["kv_ranks"] == 2
        r = decode(cluster["d0"], path, body, params)
        assert r.status_code == 400 and r.json()["error"]["code"] == "kv_transfer_params_unsupported", r.text
        r = decode(procs["d"], path, body, params)
        assert r.status_code == 200, r.text
        got, want = r.json()["choices"][0], colocated(cluster, path, body)["choices"][0]
        assert got["text"] == want["text"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        # TP 2 sums its halves in another order than TP 1: logprobs agree to rounding (test_tp_disagg.py)
        assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-4)
        for proc in procs.values():
            wait_idle(proc.url)
        rank1 = [float(line.rsplit(" ", 1)[1]) for line in httpx.get(procs["d"].url + "/metrics", timeout=5).text
                 .splitlines() if line.startswith("pdserve:kv_rank_transfer_bytes_total{") and 'rank="1"' in line]
        assert rank1 and rank1[0] > 0  # rank 1 pulled its half from the prefill node's rank 1
    finally:
        stop_all(procs.values())
