"""Fallbacks and whose fault an error is (issue 33, items 3 and 4), on real processes: a proxy
with one prefill node, two decode nodes and a colocated node for reference.

In order, because the later drills kill nodes: a request's own fault (a schema no finite value
satisfies, a grammar the engine gives up on, bad sampling parameters) is a 400 naming the field
and never migrates; a decode node that no prefill node can pair with (TP 2 beside TP 1) is
listed as not ready in the proxy's /ready; the only prefill node killed mid-prefill leaves the
decode node to compute the prompt (200, the colocated text), and so on once it is evicted; with
every decode node dead a new request is a 503 ``no_node_available`` before the registry has even
evicted them. Keyless and with a cluster key (the issue saw the request after the kill fail with
a key too).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from common.cluster_auth import ClusterKey
from helpers.cluster import Proc, metric, start, stop_all
from helpers.waiting import wait_until

pytestmark = pytest.mark.slow

PROMPT = "The with statement is used to wrap the execution of a block"
# every value must hold another one: llguidance compiles it and fails at the first token
RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
# the same recursion through patternProperties, which the schema check does not model: it fails
# in the grammar engine at the first token, and must still be the request's fault
ENGINE_LIMIT = {"type": "object", "patternProperties": {"^a$": {"$ref": "#"}}, "required": ["a"]}
LIBRARY_WORDS = ("Too many items", "ff_tokens", "lexeme", "non-verbose", "parser error", "llguidance")


class Nodes(dict[str, Proc]):
    """The cluster's processes by name, and the flags that give a process the cluster key (or none)."""

    key_args: tuple[str, ...] = ()


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """The reference node, one for both clusters (keyless and keyed answer alike). Not waited for
    here: it loads while the first cluster does."""
    proc = start("both", tmp_path_factory.mktemp("fallbacks-colocated"), wait=False)
    yield proc
    proc.stop()


@pytest.fixture(scope="module", params=["keyless", "keyed"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            colocated: Proc) -> Iterator[Nodes]:
    tmp = tmp_path_factory.mktemp("fallbacks")
    procs = Nodes()
    if request.param == "keyed":
        procs.key_args = ("--cluster-key-file", str(ClusterKey.generate(tmp / "cluster.key")))
    # the drills' dead nodes stay listed this long: their fallbacks must not wait for an eviction
    proxy = start("proxy", tmp, *procs.key_args, "--disagg-policy", "always", "--heartbeat-timeout-s", "4",
                  "--migration-limit", "2", wait=False)
    procs["proxy"] = proxy
    try:
        node = (*procs.key_args, "--proxy", f"127.0.0.1:{proxy.kv_port}", "--heartbeat-interval-s", "0.5")
        procs["prefill"] = start("prefill", tmp, *node, wait=False)
        procs["decode1"] = start("decode", tmp, *node, name="decode1", wait=False)
        procs["decode2"] = start("decode", tmp, *node, name="decode2", wait=False)
        for proc in [*procs.values(), colocated]:
            proc.wait_ready()
        wait_until(lambda: _ready(proxy).get("nodes") == {"P": 1, "D": 2}, "both decode nodes registered")
        procs["both"] = colocated
        yield procs
    finally:
        stop_all(proc for name, proc in procs.items() if name != "both")


def _ready(proxy: Proc) -> dict:
    return httpx.get(proxy.url + "/ready", timeout=5).json()


def _registered(proxy: Proc, node_type: str) -> float:
    text = httpx.get(proxy.url + "/metrics", timeout=5).text
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("pdserve:registered_nodes{") and f'type="{node_type}"' in line)


def _migrations(proxy: Proc, cause: str = "") -> float:
    """``pdserve:proxy_migrations_total`` over every cause, or those starting with ``cause``."""
    text = httpx.get(proxy.url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve:proxy_migrations_total{") and f'cause="{cause}' in line)


def _body(**extra) -> dict:
    return {"model": "pdserve-tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, **extra}


def _schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _events(proc: Proc, body: dict) -> tuple[int, list]:
    with httpx.stream("POST", proc.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        if r.status_code != 200:
            return r.status_code, [json.loads(r.read())]
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return 200, [line if line == "[DONE]" else json.loads(line) for line in lines]


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_no_value_satisfies_is_a_400_before_any_token(cluster: dict[str, Proc], stream: bool) -> None:
    before = _migrations(cluster["proxy"])
    for _ in range(3):
        body = _body(response_format=_schema(RECURSIVE))
        if stream:
            status, events = _events(cluster["proxy"], body)
            error = events[0]["error"]
        else:
            r = httpx.post(cluster["proxy"].url + "/v1/completions", json=body, timeout=120)
            status, error = r.status_code, r.json()["error"]
        assert status == 400, error
        assert error["param"] == "response_format.json_schema.schema"
        assert error["type"] == "invalid_request_error"
        assert "no finite JSON value" in error["message"]
        assert not any(word in error["message"] for word in LIBRARY_WORDS), error["message"]
    assert _migrations(cluster["proxy"]) == before


def test_a_grammar_the_engine_gives_up_on_is_the_requests_fault(cluster: dict[str, Proc]) -> None:
    """Found only at the first token: a 400 (non-stream) or an invalid_request_error event (the
    stream had begun), naming response_format, in our words; never migrated."""
    proxy, before = cluster["proxy"], _migrations(cluster["proxy"])
    body = _body(response_format=_schema(ENGINE_LIMIT))
    for proc in (cluster["both"], proxy):
        r = httpx.post(proc.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"]) == ("response_format", "response_format_failed")
        assert not any(word in error["message"] for word in LIBRARY_WORDS), error["message"]
        status, events = _events(proc, body)
        assert status == 200 and events[-1] == "[DONE]"
        errors = [e["error"] for e in events[:-1] if "error" in e]
        assert len(errors) == 1 and errors[0]["type"] == "invalid_request_error", events
        assert errors[0]["param"] == "response_format"
        assert not any(word in errors[0]["message"] for word in LIBRARY_WORDS), errors[0]["message"]
    assert _migrations(proxy) == before


@pytest.mark.parametrize(("field", "value"), [("temperature", -1.0), ("top_p", 0.0), ("n", 0),
                                              ("min_tokens", 99), ("logit_bias", {"5": 500.0})])
def test_bad_sampling_parameters_are_a_400_naming_the_field(cluster: dict[str, Proc], field: str, value) -> None:
    before = _migrations(cluster["proxy"])
    for stream in (False, True):
        r = httpx.post(cluster["proxy"].url + "/v1/completions", json=_body(stream=stream, **{field: value}),
                       timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
    assert _migrations(cluster["proxy"]) == before


def test_a_decode_node_no_prefill_node_pairs_with_is_not_ready(cluster: Nodes, tmp_path) -> None:
    """TP 2 decode beside a TP 1 prefill node (no --kv-ranks 2): registered, listed as not ready
    for its role with the reason, and a warning in the proxy's log."""
    proxy = cluster["proxy"]
    odd = start("decode", tmp_path, *cluster.key_args, "--proxy", f"127.0.0.1:{proxy.kv_port}",
                "--heartbeat-interval-s", "0.5", "--tensor-parallel-size", "2", name="decode-tp2")
    try:
        address = f"127.0.0.1:{odd.port}"
        wait_until(lambda: _ready(proxy).get("nodes") == {"P": 1, "D": 3}, "the TP 2 decode node registered")
        ready = _ready(proxy)
        assert ready["status"] == "ready"  # the other nodes still pair
        assert ready["ready_nodes"] == {"P": 1, "D": 2}
        [unpaired] = ready["unpaired"]
        assert (unpaired["type"], unpaired["http_address"]) == ("D", address)
        assert "TP size 2" in unpaired["reason"] and "--kv-ranks" in unpaired["reason"]
        wait_until(lambda: f"decode node {address} is registered but not ready" in proxy.log.read_text(),
                   "the proxy's warning")
    finally:
        odd.stop()


def test_the_only_prefill_node_killed_mid_prefill(cluster: dict[str, Proc]) -> None:
    """The decode node computes the prompt itself: 200 with the colocated text, a slower first
    token rather than an error; the next request too, while the dead node is still listed."""
    proxy, prefill = cluster["proxy"], cluster["prefill"]
    body = _body(prompt=f"Drill {time.time_ns()}: {PROMPT}")
    want = httpx.post(cluster["both"].url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    decodes = [cluster["decode1"], cluster["decode2"]]
    undisturbed = time.perf_counter()
    assert httpx.post(proxy.url + "/v1/completions", json=_body(prompt=f"Before {time.time_ns()}: {PROMPT}"),
                      timeout=120).status_code == 200
    undisturbed = time.perf_counter() - undisturbed
    blamed = _migrations(proxy, "decode")
    prefill.popen.send_signal(signal.SIGSTOP)  # the decode node surely waits for its KV
    result: dict = {}
    started = time.perf_counter()
    worker = threading.Thread(target=lambda: result.update(
        r=httpx.post(proxy.url + "/v1/completions", json=body, timeout=120), at=time.perf_counter()))
    worker.start()
    try:
        wait_until(lambda: sum(metric(d.url, "pdserve:num_requests_waiting") for d in decodes) >= 1,
                   "a decode node waiting for the prefill node's KV")
    finally:
        prefill.kill()
    worker.join(timeout=120)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    # the decode node whose KV never came is not blamed for it (with one decode node, it serves the retry)
    assert _migrations(proxy, "decode") == blamed
    print(f"\nfallback answer {result['at'] - started:.2f} s after sending (prefill node frozen, then killed), "
          f"undisturbed {undisturbed:.2f} s")
    again = _body(prompt=f"Again {time.time_ns()}: {PROMPT}")
    want = httpx.post(cluster["both"].url + "/v1/completions", json=again, timeout=120).json()["choices"][0]["text"]
    status, events = _events(proxy, {**again, "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1] == "[DONE]", events
    assert not [e for e in events if isinstance(e, dict) and "error" in e], events
    assert "".join(c["choices"][0]["text"] for c in events[:-1] if isinstance(c, dict) and c["choices"]) == want


def test_with_no_prefill_node_registered_the_decode_nodes_serve_alone(cluster: dict[str, Proc]) -> None:
    proxy = cluster["proxy"]
    wait_until(lambda: _registered(proxy, "P") == 0, "the dead prefill node evicted")
    assert "no compatible prefill/decode pair" in _ready(proxy)["error"]["message"]  # not ready: no pair
    body = _body(prompt=f"Alone {time.time_ns()}: {PROMPT}")
    want = httpx.post(cluster["both"].url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    assert 'reason="no_prefill_node"' in httpx.get(proxy.url + "/metrics", timeout=5).text


def test_every_decode_node_dead_is_a_503_at_once(cluster: dict[str, Proc]) -> None:
    proxy = cluster["proxy"]
    for name in ("decode1", "decode2"):
        cluster[name].kill()
    for stream in (False, True):
        r = httpx.post(proxy.url + "/v1/completions", json=_body(stream=stream), timeout=60)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "no_node_available" and error["type"] == "service_unavailable_error"
    assert _registered(proxy, "D") == 2  # not evicted yet: the 503 did not wait for heartbeats to stop
