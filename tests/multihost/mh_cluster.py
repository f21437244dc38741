"""The 2P2D cluster across network namespaces the multi-host tests share, and their helpers.

Hosts (each its own namespace and address): ``proxy`` (registry-fed, concurrent
dispatch), ``proxy2`` (static node list, prefill_first dispatch), ``p1``, ``p2``,
``d1``, ``d2``. A colocated node on loopback is the parity reference. Every test that
breaks a link heals it in a ``finally`` and leaves the cluster serving.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from common.request_id import make_request_id
from helpers.cluster import Proc, start, wait_idle
from helpers.netns import Bed, NsProc

HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 3.0  # the proxy evicts a node after about three missed heartbeats
KV_TIMEOUT_S = 3.0
KV_LEASE_S = 8.0
CONNECT_TIMEOUT_S = 2.0
# a node a leg could not reach gets no request another node can take this long (default 10 s): longer
# than a test's burst of requests takes, so the burst never tries the cut node again
UNREACHABLE_COOLDOWN_S = 5.0
DAEMON_ARGS = ("--heartbeat-interval-s", str(HEARTBEAT_S), "--kv-timeout-s", str(KV_TIMEOUT_S),
               "--kv-lease-s", str(KV_LEASE_S))
# every request takes the P -> D path these tests cut (auto may prefill a short prompt on D)
PROXY_ARGS = ("--connect-timeout-s", str(CONNECT_TIMEOUT_S), "--first-token-timeout-s", "60",
              "--unreachable-cooldown-s", str(UNREACHABLE_COOLDOWN_S),
              "--disagg-policy", "always")


@dataclass
class Cluster:
    bed: Bed
    proxy: NsProc
    proxy2: NsProc
    prefills: list[NsProc]
    decodes: list[NsProc]
    colocated: Proc

    @property
    def daemons(self) -> list[NsProc]:
        return self.prefills + self.decodes

    @property
    def members(self) -> list[NsProc]:
        """The daemons and both proxies: every process in the bed."""
        return [self.proxy, self.proxy2, *self.daemons]


def series(url: str, name: str) -> dict[str, float]:
    """Every sample of metric ``name`` at ``url``, keyed by its label text."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name):].rsplit(" ", 1)
            out[labels] = float(value)
    return out


def registered(proxy: NsProc) -> dict[str, int]:
    """How many nodes of each type (P, D) the proxy's registry holds now."""
    counts = series(proxy.url, "pdserve:registered_nodes")
    return {t: int(next((v for k, v in counts.items() if f'type="{t}"' in k), 0)) for t in ("P", "D")}


def node_requests(proxy: NsProc, node: NsProc) -> float:
    """Legs the proxy has sent to ``node``."""
    address = f"{node.host.ip}:{node.port}"
    return sum(v for k, v in series(proxy.url, "pdserve:proxy_node_requests_total").items() if address in k)


def wait_for(what: str, check, timeout: float) -> float:
    """Poll ``check()`` until true; returns the seconds it took, fails after ``timeout``."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - t0



LONG_PROMPT = list(range(10, 1510))  # 1,500 tokens: several prefill chunks
PROMPTS = ["The quick brown fox", "def main():\n    return", "In the beginning", "Network namespaces are"]


def complete(url: str, prompt: str, max_tokens: int = 8, timeout: float = 60) -> httpx.Response:
    body = {"model": "pdserve-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def colocated_text(cluster: Cluster, body: dict) -> str:
    """The reference answer: ``body`` served by the colocated node."""
    return text_of(httpx.post(cluster.colocated.url + "/v1/completions", json=body, timeout=60))


def warm_pairs(prefills: list[NsProc], decodes: list[NsProc]) -> None:
    """One short request through each (P, D) pair, so the KV links a test is about to use exist
    before its baseline is counted (an idle link is retired after 60 s, then built anew)."""
    body = {"prompt": PROMPTS[1], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    for p in prefills:
        for d in decodes:
            serve_pair(p, d, body)
    for node in (*prefills, *decodes):
        wait_idle(node.url)


def process_counts(procs: list[NsProc]) -> dict[str, tuple[int, int]]:
    """(threads, open FDs) of each process, by name."""
    return {proc.name: proc.counts() for proc in procs}


def assert_nothing_leaked(procs: list[NsProc], before: dict[str, tuple[int, int]], extra_fds: int = 4,
                          timeout: float = 20.0) -> None:
    """Each process back within one thread and ``extra_fds`` sockets of ``before``. Polled: idle
    peer links and keep-alive sockets close on their own timers; a leak never comes back."""
    deadline = time.monotonic() + timeout
    while True:
        now = process_counts(procs)
        grown = {n: (before[n], now[n]) for n in before
                 if now[n][0] > before[n][0] + 1 or now[n][1] > before[n][1] + extra_fds}
        if not grown:
            return
        assert time.monotonic() < deadline, f"(threads, fds) before -> after: {grown}"
        time.sleep(0.05)


def assert_all_idle(cluster) -> None:
    for node in cluster.daemons:
        wait_idle(node.url, timeout=15)


def tagged(node, body: dict, rid: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(node.url + "/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=timeout)


def serve_pair(prefill, decode, body: dict) -> str:
    """One request through ``prefill`` -> ``decode`` as the proxy sends it (both legs at once)."""
    rid = make_request_id(prefill.kv_addr, decode.kv_addr)
    with ThreadPoolExecutor(1) as pool:
        p = pool.submit(tagged, prefill, {**body, "max_tokens": 1}, rid)
        d = tagged(decode, body, rid)
        assert p.result().status_code == 200, p.result().text
    return text_of(d)


def start_cluster(tmp: Path) -> Cluster:
    """Start the bed, the hosts and every process; stops what it started if one fails."""
    bed = Bed()
    colocated = None
    try:
        hosts = {name: bed.add_host(name) for name in ("proxy", "proxy2", "p1", "p2", "d1", "d2")}
        registry = f"{hosts['proxy'].ip}:30001"
        proxy = bed.start("proxy", hosts["proxy"], tmp, *PROXY_ARGS, "--heartbeat-timeout-s",
                          str(HEARTBEAT_TIMEOUT_S), "--sweep-interval-s", "0.25", wait=False)
        roles = (("prefill", "p1"), ("prefill", "p2"), ("decode", "d1"), ("decode", "d2"))
        daemons = [bed.start(role, hosts[name], tmp, *DAEMON_ARGS, "--proxy", registry, wait=False)
                   for role, name in roles]
        colocated = start("both", tmp, name="colocated", wait=False)
        for proc in (*daemons, colocated):
            proc.wait_ready(timeout=300)
        static = []
        for flag, procs in (("--static-prefill", daemons[:2]), ("--static-decode", daemons[2:])):
            static += [flag, *(f"{p.host.ip}:{p.port}@{p.kv_addr}" for p in procs)]
        proxy2 = bed.start("proxy", hosts["proxy2"], tmp, *PROXY_ARGS, "--dispatch", "prefill_first", *static,
                           name="proxy2")
        proxy.wait_ready()
        wait_for("all four daemons registered", lambda: registered(proxy) == {"P": 2, "D": 2}, 30)
        return Cluster(bed, proxy, proxy2, daemons[:2], daemons[2:], colocated)
    except BaseException:
        stop_cluster(bed, colocated)
        raise


def stop_cluster(bed: Bed, colocated: Proc | None) -> None:
    if colocated is not None:
        colocated.stop()
    bed.close()
