"""The planner against real processes (issue 36): a proxy with ``--planner on`` in front of one
prefill and two decode daemons (``pdserve prefill|decode``, which can flip; the embedded tiny model). Long prompts arrive (two clients): the prefill node's
queue passes the TTFT SLO while the decode nodes idle, so a decode node is flipped to prefill.
Then the long prompts stop and chat with long answers comes: the one decode node left passes the
ITL SLO while one prefill node carries the short prompts, so a prefill node goes back to decode.
Every request is answered 200 throughout."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from helpers.cluster import labelled, start, stop_all
from helpers.flippable import start_flippable

# short intervals: a look every 0.3 s, two looks to agree, 1 s cold and 1 s between actions
PLANNER = ("--planner", "on", "--planner-interval-s", "0.3", "--planner-hysteresis", "2",
           "--planner-warmup-s", "1", "--planner-cooldown-s", "1", "--disagg-policy", "always",
           "--slo-ttft-ms", "400", "--slo-itl-ms", "3")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("planner")
    procs = [start("proxy", tmp, *PLANNER, wait=False)]
    try:
        registry = f"127.0.0.1:{procs[0].kv_port}"
        node = ("--proxy", registry, "--heartbeat-interval-s", "0.3", "--drain-timeout-s", "10")
        procs.append(start_flippable("prefill", tmp, *node, name="p0"))
        procs += [start_flippable("decode", tmp, *node, name=f"d{i}") for i in range(2)]
        for proc in procs[1:]:
            proc.wait_ready()
        procs[0].wait_ready(timeout=60)
        yield procs[0]
    finally:
        stop_all(procs)


class Load:
    """``clients`` threads sending completions until stopped; every status kept."""

    def __init__(self, url: str, prompt: str, max_tokens: int, clients: int) -> None:
        self.statuses: list[int] = []
        self._stop = threading.Event()
        body = {"model": "pdserve-tiny", "max_tokens": max_tokens, "ignore_eos": True}
        self._threads = [threading.Thread(target=self._client, args=(url, prompt, body), daemon=True)
                         for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _client(self, url: str, prompt: str, body: dict) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                # a prompt of its own each time: the prefix cache must not make long prompts cheap
                response = client.post(f"{url}/v1/completions", json={**body, "prompt": f"{uuid.uuid4()} {prompt}"})
                self.statuses.append(response.status_code)

    def stop(self) -> list[int]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
        return self.statuses


def nodes(url: str) -> dict[str, int]:
    return httpx.get(f"{url}/ready", timeout=5).json()["nodes"]


def wait_for_nodes(url: str, want: dict[str, int], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while (now := nodes(url)) != want:
        assert time.monotonic() < deadline, f"nodes {now}, wanted {want}; proxy log:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def wait_for_flips(url: str, count: int, timeout: float = 10) -> None:
    """The planner counts a flip once the node's answer is in, which may come after its new role's
    heartbeat reached the registry."""
    deadline = time.monotonic() + timeout
    while (done := labelled(url, "pdserve:planner_actions_total", action="flip", outcome="ok")) < count:
        assert time.monotonic() < deadline, f"{done:g} flips counted, wanted {count}"
        time.sleep(0.05)
    assert done == count, f"{done:g} flips, wanted {count}"


def test_flips_a_decode_node_to_prefill_for_long_prompts_and_back_for_long_answers(cluster):
    url = cluster.url
    assert nodes(url) == {"P": 1, "D": 2}
    long_prompts = Load(url, "the quick brown fox jumps over the lazy dog " * 120, max_tokens=1, clients=2)
    try:
        wait_for_nodes(url, {"P": 2, "D": 1}, 20, cluster.log)
    finally:
        statuses = long_prompts.stop()
    wait_for_flips(url, 1)
    chat = Load(url, "hi", max_tokens=48, clients=8)
    try:
        wait_for_nodes(url, {"P": 1, "D": 2}, 20, cluster.log)
    finally:
        statuses += chat.stop()
    assert labelled(url, "pdserve:planner_decisions_total", action="flip", reason="over_itl") >= 1
    wait_for_flips(url, 2)
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
