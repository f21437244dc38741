"""Real processes: a client that stops reading a stream, and a prefill node that never answers.

A stalled reader is a raw socket with a tiny receive buffer that reads the response headers
and then nothing: the server's socket buffers fill and its ``send`` waits on flow control.
Within ``--stream-write-timeout-s`` the server must cut that client off and abort the work
behind it (the node's engine request; on the proxy, both legs). A prefill node that takes a
request and never answers (its HTTP server accepts, nothing replies; the proxy keeps it
listed, as it would a node that still heartbeats) must cost the client one 504 within
``--prefill-timeout-s``, and the decode node its blocks.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from common.registry_client import Heartbeater
from helpers.cluster import Proc, pd_cluster, start, stop_all, wait_idle
from helpers.waiting import wait_until

WRITE_TIMEOUT_S = 1.0
PREFILL_TIMEOUT_S = 2.0
STALL_LIMIT_S = 2.0
# the decode node's own deadline ends a wait on a silent prefill node later than these (the 504 must be
# the proxy's), and frees its blocks then: the concurrent drills wait this long for them
KV_TIMEOUT_S = 5.0
# ~2 KB of SSE per token with 20 top logprobs: thousands of tokens overflow any socket buffer
STALLING_BODY = {"model": "pdserve-tiny", "max_tokens": 3500, "temperature": 0, "ignore_eos": True,
                 "stream": True, "logprobs": True, "top_logprobs": 20,
                 "messages": [{"role": "user", "content": "Tell me about the with statement."}]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    # The daemons' own bound is long: what cuts the client off in the proxy test is the proxy.
    proxy_args = ("--stream-write-timeout-s", str(WRITE_TIMEOUT_S), "--heartbeat-timeout-s", "30")
    with pd_cluster(tmp_path_factory.mktemp("stall"), proxy_args, ("--stream-write-timeout-s", "600"),
                    ("--stream-write-timeout-s", str(WRITE_TIMEOUT_S))) as procs:
        yield procs


def _stalled_reader(port: int, body: dict, request_id: str) -> socket.socket:
    """Send ``body`` and read only the response headers; the rest is never read."""
    data = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
    sock.settimeout(60)
    sock.connect(("127.0.0.1", port))
    sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  f"x-request-id: {request_id}\r\ncontent-length: {len(data)}\r\n\r\n").encode() + data)
    head = b""
    while b"\r\n\r\n" not in head:
        piece = sock.recv(1)
        assert piece, "the server closed the connection before answering"
        head += piece
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def _rest_of(sock: socket.socket) -> bytes:
    """What the stalled client finds when it reads again: until EOF or a reset."""
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while piece := sock.recv(1 << 20):
            received += piece
    return received


def _aborted(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('pdserve:request_errors_total{kind="aborted"'))


def _answers(url: str) -> None:
    body = {"model": "pdserve-tiny", "prompt": "The with statement", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def test_a_node_cuts_off_a_client_that_stopped_reading(cluster) -> None:
    node = cluster["both"]
    before = _aborted(node.url)
    sock = _stalled_reader(node.port, STALLING_BODY, "stalled-on-node")
    try:
        wait_until(lambda: _aborted(node.url) > before, "the node aborts the stalled request", 120)
        wait_idle(node.url)  # its blocks and running slot are free while the client still holds the socket
        rest = _rest_of(sock)
    finally:
        sock.close()
    assert b"data: [DONE]" not in rest  # cut off, not finished
    log = node.log.read_text()
    assert re.search(r"request stalled-on-node: the client accepted no bytes for 1 s "
                     r"\(--stream-write-timeout-s\)", log), node.log_tail()
    _answers(node.url)


def test_the_proxy_cuts_off_a_stalled_client_and_aborts_both_legs(cluster) -> None:
    proxy, prefill, decode = cluster["proxy"], cluster["prefill"], cluster["decode"]
    before = _aborted(decode.url)
    sock = _stalled_reader(proxy.port, STALLING_BODY, "stalled-on-proxy")
    try:
        wait_until(lambda: _aborted(decode.url) > before, "the decode node aborts the leg the proxy gave up", 120)
        wait_idle(decode.url)
        wait_idle(prefill.url)
        rest = _rest_of(sock)
    finally:
        sock.close()
    assert b"data: [DONE]" not in rest
    assert "request stalled-on-proxy: the client accepted no bytes" in proxy.log.read_text(), proxy.log_tail()
    _answers(proxy.url)


class SilentServer:
    """Accepts connections, reads what comes, never answers; counts requests and connections the peer
    closed."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.first_request_at: float | None = None
        self.closed_by_peer = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while conn.recv(65536):
                with self._lock:
                    self.first_request_at = self.first_request_at or time.monotonic()
            with self._lock:
                self.closed_by_peer += 1

    def close(self) -> None:
        self.sock.close()


class StuckPrefill:
    """A prefill node whose engine got stuck on the first request it took: its HTTP server accepts
    and never answers, and its heartbeats go on saying how long its engine has been stuck, as a real
    daemon's do when a step hangs (``engine_stalled_s``)."""

    def __init__(self, fingerprint: str) -> None:
        self.http, self.kv = SilentServer(), SilentServer()
        self.fingerprint = fingerprint
        self.beats: list[Heartbeater] = []

    def info(self) -> dict:
        since = self.http.first_request_at
        return {"type": "P", "http_address": self.http.address, "zmq_address": self.kv.address,
                "model": "pdserve-tiny", "kv_fingerprint": self.fingerprint, "num_running": int(since is not None),
                "engine_stalled_s": 0.0 if since is None else time.monotonic() - since}

    def register_with(self, proxy: Proc) -> None:
        beat = Heartbeater(f"127.0.0.1:{proxy.kv_port}", self.info, interval_s=0.5)
        beat.start()
        self.beats.append(beat)

    def close(self) -> None:
        for beat in self.beats:
            beat.stop()
        self.http.close()
        self.kv.close()


@pytest.fixture(scope="module")
def stalled_prefill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A real decode daemon (listed statically) and two prefill nodes that never answer: a silent one
    listed statically (never evicted, like a node that heartbeats but reports nothing) behind one
    proxy per dispatch order, and a stuck one that registers and heartbeats behind two more."""
    tmp: Path = tmp_path_factory.mktemp("stalled-prefill")
    silent_http, silent_kv = SilentServer(), SilentServer()
    procs: list[Proc] = []
    stucks: dict[str, StuckPrefill] = {}
    try:
        decode = start("decode", tmp, "--kv-timeout-s", str(KV_TIMEOUT_S), wait=False)
        procs.append(decode)
        fingerprint = _logged_fingerprint(decode)
        nodes = f"@pdserve-tiny@{fingerprint}"
        common = ("--static-decode", f"127.0.0.1:{decode.port}@{decode.kv_addr}{nodes}")
        proxies = {}
        for dispatch in ("concurrent", "prefill_first"):
            proxies["silent", dispatch] = start(
                "proxy", tmp, *common, "--static-prefill", f"{silent_http.address}@{silent_kv.address}{nodes}",
                "--dispatch", dispatch, "--prefill-timeout-s", str(PREFILL_TIMEOUT_S), name=f"silent-{dispatch}",
                wait=False)
            proxies["stuck", dispatch] = start(
                "proxy", tmp, *common, "--dispatch", dispatch, "--node-stall-timeout-s", str(STALL_LIMIT_S),
                name=f"stuck-{dispatch}", wait=False)
        procs.extend(proxies.values())
        for dispatch in ("concurrent", "prefill_first"):  # one each: stuck on the first request it takes
            stucks[dispatch] = StuckPrefill(fingerprint)
            stucks[dispatch].register_with(proxies["stuck", dispatch])
        for proc in procs:
            proc.wait_ready()
        yield {"decode": decode, "proxies": proxies, "silent": silent_http, "stuck": stucks}
    finally:
        stop_all(procs)
        silent_http.close()
        silent_kv.close()
        for stuck in stucks.values():
            stuck.close()


def _logged_fingerprint(decode: Proc, timeout: float = 120.0) -> str:
    def found() -> re.Match | None:
        assert decode.popen.poll() is None, decode.log_tail()
        return re.search(r"fingerprint (\w+),", decode.log.read_text(errors="replace"))

    wait_until(found, "the decode node logs its KV fingerprint", timeout, step=0.2)
    return found().group(1)


def _fails_with_504(proxy: Proc, decode: Proc, node: SilentServer, stream: bool) -> dict:
    """One request through ``proxy`` to ``node``: a 504 (never a hang), the proxy hangs up on the node,
    and the decode node frees whatever it reserved. Returns the error object."""
    closed = node.closed_by_peer
    body = {"model": "pdserve-tiny", "prompt": "hello there " * 50, "max_tokens": 5, "stream": stream}
    r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60)  # the deadline: never a hang
    assert r.status_code == 504, r.text
    error = r.json()["error"]
    assert node.address in error["message"] and error["type"] == "timeout_error", error
    wait_until(lambda: node.closed_by_peer > closed, "the proxy hangs up on the prefill node", 30)
    wait_idle(decode.url, timeout=30)
    return error


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dispatch", ["concurrent", "prefill_first"])
def test_a_silent_prefill_node_costs_a_504_after_the_prefill_timeout(stalled_prefill, dispatch: str,
                                                                      stream: bool) -> None:
    proxy = stalled_prefill["proxies"]["silent", dispatch]
    error = _fails_with_504(proxy, stalled_prefill["decode"], stalled_prefill["silent"], stream)
    assert error["code"] == "timeout" and "--prefill-timeout-s" in error["message"]


@pytest.mark.parametrize("dispatch", ["concurrent", "prefill_first"])
def test_a_stuck_prefill_node_that_still_heartbeats_costs_a_504_after_the_stall_bound(
        stalled_prefill, dispatch: str) -> None:
    """The prefill timeout is left at its 300 s default: what ends the wait is the node's own word
    (its heartbeats) that its engine is stuck."""
    proxy, stuck = stalled_prefill["proxies"]["stuck", dispatch], stalled_prefill["stuck"][dispatch]
    error = _fails_with_504(proxy, stalled_prefill["decode"], stuck.http, False)
    assert error["code"] == "node_stalled" and "--node-stall-timeout-s" in error["message"]
    # while its heartbeats still say stuck, the node gets no new request: the only prefill -> 503 at once
    body = {"model": "pdserve-tiny", "prompt": "hello again", "max_tokens": 5}
    r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 503 and "stalled" in r.json()["error"]["message"], r.text
