"""The proxy kill drill (issue 31): load through two proxies, ``kill -9`` one, count what clients saw;
then restart it and time how soon it routes again. Shared by tests/proxy/test_multi_proxy_e2e.py
(which asserts on the counts) and bench/proxy_ha.py (which prints them).

Each client is a thread that loops on streamed greedy completions of one of ``PROMPTS`` through its
home proxy until told to stop, and checks each answer against the colocated text. A client knows
both proxies: when a request fails at its home (connection refused or reset, a cut stream) it is
retried once through the other, as a client or load balancer in front of several proxies does.
The kill lands while a long stream (``LONG_PROMPT``, 512 tokens) through the victim is under way,
so at least one request is cut in flight, not only refused afterwards. What counts:

- sent: requests made (retries not counted);
- succeeded: answered right at the first try;
- failed fast: failed with a connection error or a cut stream, not a timeout (the victim's, once
  it is dead); of them, cut in flight: a stream that had begun;
- retried: of those, answered right through the other proxy;
- failed: everything else (a wrong answer, an error status, a timeout, a failed retry), each
  kept with what went wrong; the drill's goal is none.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

import httpx
from helpers.cluster import Proc, restart

PROMPTS = ("The with statement is used to", "A module can contain executable statements",
           "Exceptions are identified by class instances", "The import statement combines two operations")
BODY = {"model": "pdserve-tiny", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
# the stream the kill cuts: long enough to be still streaming when the proxy dies
LONG_PROMPT, LONG_TOKENS = "Sequences are ordered collections", 512
TIMEOUT_S = 60.0  # a request slower than this counts as hung


@dataclass
class DrillCounts:
    sent: int = 0
    succeeded: int = 0
    failed_fast: int = 0
    cut_in_flight: int = 0
    retried: int = 0
    failed: list[str] = field(default_factory=list)
    survivor_ok: int = 0  # first-try successes through the survivor after the kill
    lock: threading.Lock = field(default_factory=threading.Lock)


class StreamCut(Exception):
    """A stream that began and ended without [DONE]."""


def expected_texts(colocated: Proc) -> dict[str, str]:
    """Each prompt's greedy text from the colocated reference node (``LONG_PROMPT``'s too)."""
    return {p: httpx.post(colocated.url + "/v1/completions", json={**BODY, "prompt": p, "max_tokens": _tokens(p)},
                          timeout=TIMEOUT_S).json()["choices"][0]["text"] for p in (*PROMPTS, LONG_PROMPT)}


def _tokens(prompt: str) -> int:
    return LONG_TOKENS if prompt == LONG_PROMPT else BODY["max_tokens"]


def complete(proxy: Proc, prompt: str, on_begin: Callable[[], None] | None = None) -> tuple[int, str]:
    """(status, text) of one streamed completion; raises httpx errors, or StreamCut. ``on_begin``
    is called at the stream's first line."""
    text, began = [], False
    try:
        body = {**BODY, "prompt": prompt, "max_tokens": _tokens(prompt), "stream": True}
        with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=TIMEOUT_S) as r:
            if r.status_code != 200:
                return r.status_code, r.read().decode(errors="replace")[:200]
            for line in r.iter_lines():
                if not began and on_begin is not None:
                    on_begin()
                began = True
                if line == "data: [DONE]":
                    return 200, "".join(text)
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return 500, str(event["error"])[:200]
                    text.extend(c.get("text") or "" for c in event.get("choices", []))
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        if began:
            raise StreamCut(str(exc)) from exc
        raise
    raise StreamCut("the stream ended without [DONE]")


class Load:
    """``clients`` threads per proxy, looping until :meth:`stop`; ``counts`` fills as they go."""

    def __init__(self, victim: Proc, survivor: Proc, expected: dict[str, str], clients: int = 2) -> None:
        self.victim, self.survivor, self.expected = victim, survivor, expected
        self.counts = DrillCounts()
        self.killed = threading.Event()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(home, other, i), daemon=True)
                         for i in range(clients) for home, other in ((victim, survivor), (survivor, victim))]

    def __enter__(self) -> Self:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=TIMEOUT_S + 5)

    def kill_victim(self, timeout: float = 30.0) -> None:
        """``kill -9`` the victim while a long stream through it is under way: that stream is cut,
        and retried through the survivor, as the short requests the clients send."""
        began = threading.Event()
        long = threading.Thread(target=self._one, args=(self.victim, self.survivor, LONG_PROMPT, began.set))
        long.start()
        if not began.wait(timeout):
            raise AssertionError(f"the long stream through {self.victim.name} did not begin within {timeout:g} s")
        self.victim.kill()
        self.killed.set()
        long.join(timeout=2 * TIMEOUT_S)

    def _client(self, home: Proc, other: Proc, seed: int) -> None:
        n = seed
        while not self._stop.is_set():
            self._one(home, other, PROMPTS[n % len(PROMPTS)])
            n += 1

    def _one(self, home: Proc, other: Proc, prompt: str, on_begin: Callable[[], None] | None = None) -> None:
        """One request through ``home``; one retry through ``other`` if it failed fast there."""
        c = self.counts
        with c.lock:
            c.sent += 1
        outcome, why = self._ask(home, prompt, on_begin)
        if outcome == "ok":
            with c.lock:
                c.succeeded += 1
                c.survivor_ok += home is self.survivor and self.killed.is_set()
            return
        if outcome != "fast" or home is self.survivor:
            with c.lock:
                c.failed.append(f"{home.name}: {why}")
            return
        with c.lock:
            c.failed_fast += 1
            c.cut_in_flight += why.startswith("cut")
        retry, why = self._ask(other, prompt)
        with c.lock:
            if retry == "ok":
                c.retried += 1
            else:
                c.failed.append(f"retry through {other.name}: {why}")

    def _ask(self, proxy: Proc, prompt: str, on_begin: Callable[[], None] | None = None) -> tuple[str, str]:
        """("ok" | "fast" | "bad", why) of one request."""
        try:
            status, text = complete(proxy, prompt, on_begin)
        except StreamCut as exc:
            return "fast", f"cut: {exc}"
        except httpx.TimeoutException as exc:
            return "bad", f"timed out: {exc!r}"
        except httpx.TransportError as exc:
            return "fast", f"{type(exc).__name__}: {exc}"
        if status != 200:
            return "bad", f"status {status}: {text}"
        if text != self.expected[prompt]:
            return "bad", f"wrong text for {prompt!r}: {text!r} (colocated: {self.expected[prompt]!r})"
        return "ok", ""


def wait_for_counts(load: Load, condition, what: str, timeout: float = 60.0) -> None:
    """Until ``condition(load.counts)``; fails naming ``what`` (and the counts) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition(load.counts):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what} ({load.counts})")
        time.sleep(0.05)


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Comeback:
    """Seconds from a proxy's restart to: its registry listening, its HTTP server answering, and its
    first right answer."""

    registry_s: float
    http_s: float
    routed_s: float

    @property
    def after_up_s(self) -> float:
        """From the moment it listens on both ports to its first right answer."""
        return self.routed_s - max(self.registry_s, self.http_s)


def _answers_health(proxy: Proc) -> bool:
    try:
        return httpx.get(proxy.url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def restart_and_time(proxy: Proc, expected: dict[str, str], timeout: float = 60.0) -> Comeback:
    """Restart the (dead) ``proxy`` on its ports and ask it until it answers right."""
    t0 = time.monotonic()
    restart(proxy, wait=False)
    registry_s = http_s = None
    deadline = t0 + timeout
    prompt = PROMPTS[0]
    while time.monotonic() < deadline:
        if proxy.popen.poll() is not None:
            raise RuntimeError(f"{proxy.name} exited with {proxy.popen.returncode}:\n{proxy.log_tail()}")
        if registry_s is None and proxy.kv_port and listening(proxy.kv_port):
            registry_s = time.monotonic() - t0
        if http_s is None and _answers_health(proxy):
            http_s = time.monotonic() - t0
        if registry_s is not None and http_s is not None:
            try:
                status, text = complete(proxy, prompt)
                if status == 200:
                    assert text == expected[prompt], f"{proxy.name} answered {text!r}, not {expected[prompt]!r}"
                    return Comeback(registry_s, http_s, time.monotonic() - t0)
            except (httpx.TransportError, StreamCut):
                pass
        time.sleep(0.02)
    raise AssertionError(f"{proxy.name} did not route within {timeout:g} s of its restart:\n{proxy.log_tail()}")
