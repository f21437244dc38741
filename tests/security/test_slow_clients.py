"""Slow clients (issue 22, finding 1), against a real proxy and a real node: a connection that
trickles its headers or its body, or sends nothing, is closed within the bound
(``--http-header-timeout-s`` / ``--http-body-timeout-s``) while normal requests are served, and
connections past ``--http-max-connections`` are refused with a 503, not held."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from helpers.cluster import Proc, start, stop_all
from helpers.waiting import wait_until

BOUNDS = ("--http-header-timeout-s", "1", "--http-body-timeout-s", "1")
DEADLINE_S = 30.0  # generous: the bounds are 1 to 3 s
REQUEST_LINE = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"


def _healthy(proc: Proc) -> bool:
    assert proc.popen.poll() is None, proc.log_tail()
    try:
        return httpx.get(proc.url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    tmp = tmp_path_factory.mktemp("slow")
    procs = {}
    try:
        procs["proxy"] = start("proxy", tmp, *BOUNDS, wait=False)
        procs["capped"] = start("proxy", tmp, "--http-max-connections", "4", name="capped", wait=False)
        # a longer header bound on the node: its held connections must outlive the cap test's refusals
        procs["node"] = start("both", tmp, "--http-header-timeout-s", "3", "--http-body-timeout-s", "1",
                              "--http-max-connections", "6", wait=False)
        for proc in procs.values():
            wait_until(lambda proc=proc: _healthy(proc), f"{proc.name} healthy", 120, step=0.1)
        yield procs
    finally:
        stop_all(procs.values())


class Trickler:
    """A raw connection that sends ``head`` and then one byte of ``drip`` every 0.2 s until closed."""

    def __init__(self, port: int, head: bytes, drip: bytes) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
        self.sock.sendall(head)
        self.drip = drip
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for i in range(len(self.drip)):
            if self._stop.wait(0.2):
                return
            try:
                self.sock.send(self.drip[i:i + 1])
            except OSError:
                return

    def closed_by_server(self) -> tuple[float, bytes]:
        """(seconds until the server closed the connection, what it sent before closing)."""
        start_at, got = time.monotonic(), b""
        try:
            while chunk := self.sock.recv(4096):
                got += chunk
        except ConnectionResetError:
            pass
        except TimeoutError:
            raise AssertionError(f"still open after {DEADLINE_S} s; received {got!r}") from None
        finally:
            self._stop.set()
            self.sock.close()
        return time.monotonic() - start_at, got


def _served(proc: Proc) -> bool:
    return httpx.get(proc.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("target", ["proxy", "node"])
def test_trickled_headers_are_cut_off_and_others_still_served(servers, target):
    proc = servers[target]
    slow = [Trickler(proc.port, REQUEST_LINE, b"x-slow: " + b"a" * 1000) for _ in range(3)]
    assert _served(proc)
    for t in slow:
        _, got = t.closed_by_server()
        assert got.startswith(b"HTTP/1.1 408") and b"--http-header-timeout-s" in got, got
    assert _served(proc)


@pytest.mark.parametrize("target", ["proxy", "node"])
def test_a_silent_connection_is_cut_off(servers, target):
    proc = servers[target]
    _, got = Trickler(proc.port, b"", b"").closed_by_server()
    assert got.startswith(b"HTTP/1.1 408"), got


@pytest.mark.parametrize("target", ["proxy", "node"])
def test_a_trickled_body_is_cut_off(servers, target):
    proc = servers[target]
    head = REQUEST_LINE + b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n{"
    slow = Trickler(proc.port, head, b'"prompt": "' + b"a" * 900)
    assert _served(proc)
    _, got = slow.closed_by_server()
    assert got.startswith(b"HTTP/1.1 408") and b"--http-body-timeout-s" in got, got
    r = httpx.post(proc.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code in (200, 503), r.text  # the bare proxy has no node: 503, but it answered


@pytest.mark.parametrize("target", ["capped", "node"])
def test_connections_past_the_cap_are_refused_not_held(servers, target):
    proc = servers[target]
    cap = 4 if target == "capped" else 6
    held = [socket.create_connection(("127.0.0.1", proc.port), timeout=DEADLINE_S) for _ in range(cap)]
    try:
        for _ in range(3):  # each one past the cap: a 503 and closed at once
            with socket.create_connection(("127.0.0.1", proc.port), timeout=DEADLINE_S) as extra:
                got = b""
                while chunk := extra.recv(4096):
                    got += chunk
            assert got.startswith(b"HTTP/1.1 503") and b"--http-max-connections" in got, got
    finally:
        for sock in held:
            sock.close()
    # the slots free as the server sees the closes
    wait_until(lambda: _healthy(proc), "serving again after the held connections closed", DEADLINE_S, step=0.05)
