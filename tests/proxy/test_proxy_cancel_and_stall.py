"""Real proxy + prefill + decode (+ a colocated node): what a client that leaves, a node that
stalls, an idle connection and a huge prompt cost the cluster.

Every test ends with the nodes idle (no running request, no used KV block) and serving.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading

import httpx
import pytest

from helpers.cluster import metric, pd_cluster, wait_idle
from helpers.waiting import wait_until

LONG = 3000  # max_tokens that would take far longer than any deadline here
IDLE_S = 2.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    keep_alive = ("--keep-alive-timeout-s", "1")
    proxy_args = ("--heartbeat-timeout-s", "30", "--stream-idle-timeout-s", str(IDLE_S), *keep_alive)
    with pd_cluster(tmp_path_factory.mktemp("cancel-stall"), proxy_args, keep_alive, keep_alive) as procs:
        yield procs


def _body(path: str, stream: bool, max_tokens: int = LONG) -> dict:
    body: dict = {"model": "pdserve-tiny", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                  "stream": stream}
    if path == "/v1/chat/completions":
        return body | {"messages": [{"role": "user", "content": "Tell me about the with statement."}]}
    return body | {"prompt": "The with statement"}


def _send_raw(port: int, path: str, body: dict) -> socket.socket:
    """A request on a raw socket, so the test can hang up exactly when it wants."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n")
    sock.sendall(head.encode() + data)
    return sock


def _wait_running(url: str, timeout: float = 60.0) -> None:
    wait_until(lambda: metric(url, "pdserve:num_requests_running") >= 1, f"{url} starts the request", timeout,
               step=0.05)


def _generated(url: str) -> float:
    return metric(url, "pdserve:generation_tokens_total")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_client_disconnect_through_the_proxy_aborts_both_legs(cluster, path: str, stream: bool) -> None:
    proxy, prefill, decode = cluster["proxy"], cluster["prefill"], cluster["decode"]
    before = _generated(decode.url)
    sock = _send_raw(proxy.port, path, _body(path, stream))
    try:
        _wait_running(decode.url)
    finally:
        sock.close()
    wait_idle(decode.url, timeout=30)
    wait_idle(prefill.url, timeout=30)
    assert _generated(decode.url) - before < LONG / 2  # stopped long before max_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_on_a_node_aborts_the_request(cluster, stream: bool) -> None:
    node = cluster["both"]
    before = _generated(node.url)
    sock = _send_raw(node.port, "/v1/completions", _body("/v1/completions", stream))
    try:
        _wait_running(node.url)
    finally:
        sock.close()
    wait_idle(node.url, timeout=30)
    assert _generated(node.url) - before < LONG / 2


def test_a_stopped_decode_node_ends_the_stream_and_both_nodes_free_their_blocks(cluster) -> None:
    proxy, prefill, decode = cluster["proxy"], cluster["prefill"], cluster["decode"]
    body = _body("/v1/completions", True)
    events: list[str] = []
    stopped = False
    try:
        with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                if len(events) == 3 and not stopped:
                    os.kill(decode.popen.pid, signal.SIGSTOP)
                    stopped = True
    finally:
        if stopped:
            os.kill(decode.popen.pid, signal.SIGCONT)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "stream_idle_timeout" and decode.url.removeprefix("http://") in error["message"]
    wait_idle(decode.url, timeout=30)  # it saw the proxy hang up once it ran again
    wait_idle(prefill.url, timeout=30)
    after = httpx.post(proxy.url + "/v1/completions", json=_body("/v1/completions", False, 4), timeout=60)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("name", ["proxy", "decode", "both"])
def test_idle_keep_alive_connections_are_closed(cluster, name: str) -> None:
    proc = cluster[name]
    with socket.create_connection(("127.0.0.1", proc.port), timeout=20) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        received = b""
        while b'"ok"' not in received:
            received += sock.recv(65536)
        assert received.startswith(b"HTTP/1.1 200")
        assert sock.recv(65536) == b""  # the server closed the idle connection (not our 20 s timeout)


def test_huge_prompts_do_not_starve_health_or_heartbeats(cluster) -> None:
    proxy, both = cluster["proxy"], cluster["both"]
    prompt = "hello world " * (4 * 1024 * 1024 // 12 - 20)  # just under the 4 MiB body limit
    medium = "hello world " * 25_000  # under the character bound: really tokenized (off the loop)
    failures: list[BaseException] = []
    done = threading.Event()

    def poll_health() -> None:
        urls = [proxy.url, both.url, cluster["decode"].url, cluster["prefill"].url]
        while not done.is_set():
            for url in urls:
                try:
                    assert httpx.get(url + "/health", timeout=2.0).status_code == 200
                except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                    failures.append(exc)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        for url in (proxy.url, both.url):
            for text in (prompt, medium):
                body = {"model": "pdserve-tiny", "prompt": text}
                r = httpx.post(url + "/v1/completions", json=body, timeout=60)
                assert r.status_code == 400, r.text[:300]
                assert r.json()["error"]["code"] == "context_length_exceeded"
    finally:
        done.set()
        poller.join()
    assert not failures, failures[:3]
    counts = httpx.get(proxy.url + "/metrics").text
    assert 'pdserve:registered_nodes{role="proxy",type="P"} 1.0' in counts
    assert 'pdserve:registered_nodes{role="proxy",type="D"} 1.0' in counts


def test_continuous_usage_ids_and_echo_through_the_proxy(cluster) -> None:
    proxy = cluster["proxy"]
    body = _body("/v1/chat/completions", True, 5) | {
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"X-Request-Id": "bench-7"}) as r:
        assert r.headers["x-request-id"] == "bench-7"
        lines = [ln.removeprefix("data: ") for ln in r.iter_lines() if ln]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(ln) for ln in lines[:-1]]
    assert all("usage" in c and c["id"].startswith("chatcmpl-") for c in chunks)
    assert all("prefill_addr" not in c["id"] for c in chunks)
    completion = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion == sorted(completion) and completion[-1] == 5
