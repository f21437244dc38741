"""Kill drills (issue 22): proxy + 2 prefill + 2 decode daemons, real processes.

A node serving a stream is killed (SIGKILL) or frozen (SIGSTOP) mid-answer; the client must
still get the whole answer, with exactly the tokens of an undisturbed run, one role chunk, usage
over the whole answer, and the surviving nodes must end with no KV block in use.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import pytest

from helpers.cluster import Proc, metric, start, stop_all, wait_idle
from helpers.waiting import wait_until

MAX_TOKENS = 400
IDLE_S = 3.0
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


class Cluster:
    def __init__(self, tmp) -> None:
        self.tmp = tmp
        self.proxy = start("proxy", tmp, "--heartbeat-timeout-s", "2", "--stream-idle-timeout-s", str(IDLE_S),
                           "--disagg-policy", "always", "--migration-limit", "2", wait=False)
        self.nodes: list[Proc] = []
        self.serial = 0
        for role in ("prefill", "prefill", "decode", "decode"):  # started together: model loads overlap
            self.add(role, wait=False)
        for node in self.nodes:
            node.wait_ready()
        self.proxy.wait_ready(timeout=60)
        self.wait_registered()

    def add(self, role: str, wait: bool = True) -> Proc:
        self.serial += 1
        node = start(role, self.tmp, "--proxy", f"127.0.0.1:{self.proxy.kv_port}", "--heartbeat-interval-s",
                     "0.5", name=f"{role}{self.serial}", wait=wait)
        self.nodes.append(node)
        return node

    def live(self, role: str) -> list[Proc]:
        return [n for n in self.nodes if n.name.startswith(role) and n.popen.poll() is None]

    def wait_registered(self, p: int = 2, d: int = 2, timeout: float = 30.0) -> None:
        """Until the proxy lists ``p`` prefill and ``d`` decode nodes."""
        wait_until(lambda: httpx.get(self.proxy.url + "/ready", timeout=5).json().get("nodes") == {"P": p, "D": d},
                   f"the proxy lists {p} prefill and {d} decode nodes", timeout, step=0.1)

    def replace(self, victim: Proc) -> None:
        """Kill ``victim`` for good and start a fresh node of its role, which loads while the proxy
        evicts the victim."""
        victim.kill()
        self.nodes.remove(victim)
        fresh = self.add(victim.name.rstrip("0123456789"), wait=False)
        wait_until(lambda: not self.listed(victim), f"the proxy evicts {victim.name}")
        fresh.wait_ready()
        self.wait_registered()

    def listed(self, node: Proc) -> bool:
        """Whether the proxy's log leaves ``node`` registered (a frozen node may have been evicted and
        have registered again once thawed)."""
        address = re.compile(rf"node (registered|evicted|said goodbye)\b.*: [PD] 127\.0\.0\.1:{node.port}(\s|$)")
        events = [m.group(1) for m in map(address.search, self.proxy.log.read_text(errors="replace").splitlines()) if m]
        return bool(events) and events[-1] == "registered"

    def heal(self) -> None:
        """After a test that failed before its own ``replace``: every node that died is replaced, so
        the next drill starts from two live nodes of each role, not from the wreck of this one."""
        for node in list(self.nodes):
            if node.popen.poll() is None:
                node.popen.send_signal(signal.SIGCONT)  # a frozen victim thaws (no-op when running)
                continue
            self.nodes.remove(node)
            self.add(node.name.rstrip("0123456789"))
        self.wait_registered()

    def stop(self) -> None:
        for node in [*self.nodes, self.proxy]:
            if node.popen.poll() is None:
                try:
                    node.popen.send_signal(signal.SIGCONT)
                except ProcessLookupError:
                    pass
        stop_all([*self.nodes, self.proxy])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(tmp_path_factory.mktemp("drills"))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(autouse=True)
def _healed(cluster: Cluster):
    yield
    cluster.heal()


def _body(path: str, stream: bool, **extra) -> dict:
    body: dict = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if path == CHAT:
        return body | {"messages": [{"role": "user", "content": "Tell me about the with statement."}]}
    return body | {"prompt": "The with statement is used to wrap the execution of a block"}


class StreamReader(threading.Thread):
    """Reads one SSE stream to its end; ``first_content`` is set when content arrived."""

    def __init__(self, url: str, path: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.first_content = threading.Event()
        self.events: list[dict | str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + self.path, json=self.body, timeout=120) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        assert not line.startswith(":"), f"a node's note reached the client: {line!r}"
                        continue
                    payload = line[6:]
                    event = payload if payload == "[DONE]" else json.loads(payload)
                    self.events.append(event)
                    if isinstance(event, dict) and _text(event):
                        self.first_content.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.first_content.set()

    def answer(self) -> tuple[str, dict]:
        self.join(timeout=180)
        assert self.error is None, self.error
        assert self.events and self.events[-1] == "[DONE]", self.events[-3:]
        chunks = [e for e in self.events[:-1] if isinstance(e, dict)]
        errors = [e for e in chunks if "error" in e]
        assert not errors, errors
        roles = [c for c in chunks for ch in c["choices"] if "role" in ch.get("delta", {})]
        assert len(roles) <= 1, "a second role chunk"
        assert len({c["id"] for c in chunks}) == 1, "chunk ids changed mid-stream"
        finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
        assert finishes == ["length"], finishes
        usage = [c["usage"] for c in chunks if c.get("usage")]
        counts = {k: usage[-1][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        return "".join(_text(c) for c in chunks), counts


def _text(chunk: dict) -> str:
    return "".join(ch.get("text") or (ch.get("delta") or {}).get("content") or "" for ch in chunk.get("choices", []))


def _serving(nodes: list[Proc], timeout: float = 30.0) -> Proc:
    """The node with a request running."""
    running: list[Proc] = []
    wait_until(lambda: running.extend(n for n in nodes if metric(n.url, "pdserve:num_requests_running") >= 1)
               or running, "a node runs the request", timeout, step=0.02)
    return running[0]


def _migrations(cluster: Cluster, cause: str) -> float:
    text = httpx.get(cluster.proxy.url + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("pdserve:proxy_migrations_total{") and f'cause="{cause}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _reference(cluster: Cluster, path: str, **extra) -> tuple[str, dict]:
    reader = StreamReader(cluster.proxy.url, path, _body(path, True, **extra))
    reader.start()
    return reader.answer()


@pytest.fixture(scope="module")
def undisturbed(cluster: Cluster):
    """``undisturbed(path, **extra)``: an undisturbed run's (text, usage), asked once for the module
    (greedy or seeded, so every live node gives the same)."""
    answers: dict[tuple, tuple[str, dict]] = {}

    def answer(path: str, **extra) -> tuple[str, dict]:
        key = (path, *sorted(extra.items()))
        if key not in answers:
            answers[key] = _reference(cluster, path, **extra)
        return answers[key]

    return answer


def _all_idle(cluster: Cluster) -> None:
    for node in cluster.nodes:
        if node.popen.poll() is None:
            wait_idle(node.url, timeout=30)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_decode_killed_mid_stream(cluster: Cluster, undisturbed, path: str) -> None:
    want_text, want_usage = undisturbed(path)
    before = _migrations(cluster, "decode_lost")
    reader = StreamReader(cluster.proxy.url, path, _body(path, True))
    reader.start()
    assert reader.first_content.wait(60)
    victim = _serving(cluster.live("decode"))
    victim.kill()
    text, usage = reader.answer()
    assert text == want_text
    assert usage == want_usage
    assert _migrations(cluster, "decode_lost") == before + 1
    _all_idle(cluster)
    cluster.replace(victim)


def test_seeded_stream_resumes_with_the_same_tokens(cluster: Cluster, undisturbed) -> None:
    seeded = {"temperature": 0.9, "seed": 1234}
    want_text, want_usage = undisturbed(COMPLETIONS, **seeded)
    reader = StreamReader(cluster.proxy.url, COMPLETIONS, _body(COMPLETIONS, True, **seeded))
    reader.start()
    assert reader.first_content.wait(60)
    victim = _serving(cluster.live("decode"))
    victim.kill()
    assert reader.answer() == (want_text, want_usage)
    _all_idle(cluster)
    cluster.replace(victim)


def test_decode_frozen_past_the_stall_bound(cluster: Cluster, undisturbed) -> None:
    want_text, want_usage = undisturbed(CHAT)
    before = _migrations(cluster, "decode_stalled")
    reader = StreamReader(cluster.proxy.url, CHAT, _body(CHAT, True))
    reader.start()
    assert reader.first_content.wait(60)
    victim = _serving(cluster.live("decode"))
    victim.popen.send_signal(signal.SIGSTOP)
    try:
        assert reader.answer() == (want_text, want_usage)
    finally:
        victim.popen.send_signal(signal.SIGCONT)
    assert _migrations(cluster, "decode_stalled") == before + 1
    _all_idle(cluster)  # the thawed node too: it aborts the request the proxy hung up on
    cluster.replace(victim)


def test_non_stream_answer_survives_its_decode_node(cluster: Cluster) -> None:
    want = httpx.post(cluster.proxy.url + COMPLETIONS, json=_body(COMPLETIONS, False), timeout=120).json()
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(r=httpx.post(
        cluster.proxy.url + COMPLETIONS, json=_body(COMPLETIONS, False), timeout=120)))
    worker.start()
    victim = _serving(cluster.live("decode"))
    wait_until(lambda: metric(victim.url, "pdserve:generation_tokens_total") >= 2, "the victim past its first tokens",
               30, step=0.02)
    victim.kill()
    worker.join(timeout=180)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]
    assert r.json()["usage"] == want["usage"]
    _all_idle(cluster)
    cluster.replace(victim)


def test_prefill_killed_mid_transfer(cluster: Cluster) -> None:
    """The prefill node dies with the KV not yet landed (frozen first, so the decode node is surely
    waiting for it): another prefill node computes the prompt and the client sees nothing of it.
    Two requests at once: the router gives one to each prefill node."""
    prompts = [f"Drill {time.time_ns()} {i}: the with statement wraps a block." for i in range(2)]
    victim = cluster.live("prefill")[0]
    victim.popen.send_signal(signal.SIGSTOP)  # killed within the proxy's 2 s heartbeat timeout
    try:
        readers = [StreamReader(cluster.proxy.url, COMPLETIONS, _body(COMPLETIONS, True, prompt=p)) for p in prompts]
        for reader in readers:
            reader.start()
        # the moment meant: one answer streams (from the live prefill node) while the other waits on
        # a decode node for the frozen node's KV
        wait_until(lambda: any(r.first_content.is_set() for r in readers) and
                   sum(metric(d.url, "pdserve:num_requests_waiting") for d in cluster.live("decode")) >= 1,
                   "a request waiting on a decode node for the frozen node's KV", 60, step=0.02)
        victim.kill()
        answers = [r.answer() for r in readers]
    finally:
        victim.kill()
    _all_idle(cluster)
    # whole answers, no error event, each exactly an undisturbed run's (run after: the drill's prompts
    # are new to every node, as a first request's are)
    assert answers == [_reference(cluster, COMPLETIONS, prompt=p) for p in prompts]
    cluster.replace(victim)
