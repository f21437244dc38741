"""Through proxy -> prefill -> decode, a client sees exactly what a colocated node shows it.

The shared prefill and decode daemons sit behind two proxies of this module (``--dispatch
concurrent`` and ``--dispatch prefill_first``, both listing the daemons statically), next to
the shared colocated ``serve`` node on the same embedded checkpoint. Each request goes to the colocated node
and through each proxy; the replies must match field by field except ``id`` and
``created``: text (greedy and seeded), token counts, finish reasons, logprobs (within
1e-4), usage, every chunk of a stream in order, and the status and body of bad requests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from helpers.cluster import Proc, all_ready, start, static_nodes

pytestmark = pytest.mark.slow

MODEL = "pdserve-tiny"
IGNORED = {"id", "created"}  # differ by design between any two replies
TOLERANCE = 1e-4  # logprobs: fp32 on both paths, different batch shapes
ORDERS = ("concurrent", "prefill_first")
PROMPT = "The quick brown fox jumps over"
MESSAGES = [{"role": "user", "content": "How do I read a file in Python?"}]


@pytest.fixture(scope="module")
def proxies(session_cluster: dict[str, Proc], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    """One proxy per dispatch order, listing the shared daemons statically."""
    tmp = tmp_path_factory.mktemp("fidelity")
    procs = {order: start("proxy", tmp, "--dispatch", order, *static_nodes(session_cluster, MODEL),
                          name=f"proxy-{order}", wait=False) for order in ORDERS}
    with all_ready(procs):
        yield procs


@pytest.fixture
def cluster(shared_cluster: dict[str, Proc], proxies: dict[str, Proc]) -> dict[str, Proc]:
    return {**shared_cluster, **proxies}


def post(proc: Proc, path: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(proc.url + path, content=content, headers=headers, timeout=60)


def both_paths(cluster: dict[str, Proc], order: str, path: str, body: Any) -> tuple[httpx.Response, ...]:
    """The colocated node's reply, then the reply through the proxy dispatching in ``order``."""
    return post(cluster["both"], path, body), post(cluster[order], path, body)


def stream_events(proc: Proc, path: str, body: dict) -> list[Any]:
    """Every SSE event of a streamed reply, ``[DONE]`` included, as parsed JSON."""
    events: list[Any] = []
    with httpx.stream("POST", proc.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    assert events and events[-1] == "[DONE]"
    return events


def assert_same(expected: Any, got: Any, where: str = "$") -> None:
    """Equal except ``IGNORED`` keys; floats within ``TOLERANCE``."""
    if isinstance(expected, dict) and isinstance(got, dict):
        keys = set(expected) - IGNORED
        assert keys == set(got) - IGNORED, f"{where}: keys {sorted(keys)} != {sorted(set(got) - IGNORED)}"
        for key in keys:
            assert_same(expected[key], got[key], f"{where}.{key}")
    elif isinstance(expected, list) and isinstance(got, list):
        assert len(expected) == len(got), f"{where}: {len(expected)} items != {len(got)}\n{expected}\n{got}"
        for i, (a, b) in enumerate(zip(expected, got)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(expected, float) and isinstance(got, float):
        assert abs(expected - got) <= TOLERANCE, f"{where}: {expected} != {got}"
    else:
        assert expected == got, f"{where}: {expected!r} != {got!r}"


def completion(**extra: Any) -> tuple[str, dict]:
    return "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, **extra}


def chat(**extra: Any) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 10, **extra}


# each changes the greedy / seeded answer (test_each_sampling_field_changes_the_answer)
SAMPLING_FIELDS = {
    "presence-penalty": completion(temperature=0, presence_penalty=2.0, max_tokens=16, ignore_eos=True),
    "frequency-penalty": completion(temperature=0, frequency_penalty=1.0, max_tokens=16, logprobs=1, ignore_eos=True),
    "repetition-penalty": completion(temperature=0, repetition_penalty=3.0, max_tokens=16, ignore_eos=True),
    # the prompt ends in greedy's own repetitive answer, so its next greedy token (745) is a prompt token
    "repetition-penalty-first-token": completion(temperature=0, repetition_penalty=3.0, max_tokens=1, prompt=[
        344, 1662, 828, 78, 288, 353, 90, 81, 291, 82, 91, 1629, 88, 330, 86, 835, 638, 638, 638, 638, 638, 745,
        844, 745]),
    "min-p": completion(temperature=1.5, seed=4, min_p=0.7, max_tokens=16, ignore_eos=True),
    "top-k": completion(temperature=1.5, seed=9, top_k=3, max_tokens=16, ignore_eos=True),
    "logit-bias": completion(temperature=0, logit_bias={"42": 100, "300": 30}, frequency_penalty=1.0,
                             max_tokens=8, ignore_eos=True),
    "min-tokens": completion(temperature=0, logit_bias={"1": 100}, min_tokens=5, max_tokens=8),
    "chat-all": chat(temperature=0.9, seed=2, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                     min_p=0.05, top_k=20, logit_bias={"42": 5}, min_tokens=3, logprobs=True, top_logprobs=2),
}

REQUESTS = {
    "greedy": completion(temperature=0, ignore_eos=True),
    "greedy-logprobs": completion(temperature=0, logprobs=3, ignore_eos=True),
    "seeded": completion(temperature=1.0, seed=42, ignore_eos=True),
    "seeded-top-p-top-k-logprobs": completion(temperature=0.8, top_p=0.9, top_k=40, seed=7, logprobs=2),
    "seeded-stop-string": completion(temperature=1.0, seed=3, max_tokens=24, stop=["e"]),
    "seeded-min-tokens": completion(temperature=1.2, seed=11, min_tokens=6, max_tokens=8),
    "first-token-only": completion(temperature=1.0, seed=5, max_tokens=1, logprobs=1),
    "token-prompt": ("/v1/completions", {"model": MODEL, "prompt": [5, 17, 99, 3, 42], "max_tokens": 6,
                                         "temperature": 0.7, "seed": 1, "logprobs": 0}),
    "chat-greedy-logprobs": chat(temperature=0, logprobs=True, top_logprobs=2, ignore_eos=True),
    "chat-seeded": chat(temperature=1.0, seed=99, logprobs=True),
    # n > 1: one prompt pass and transfer, the choices forked on the decode node
    "n4-greedy": completion(temperature=0, n=4, ignore_eos=True),
    "n4-seeded-logprobs-stop": completion(temperature=1.0, seed=21, n=4, logprobs=2, max_tokens=16, stop=["e"]),
    "n4-first-token-only": completion(temperature=1.0, seed=6, n=4, max_tokens=1),
    "chat-n3-seeded": chat(temperature=1.0, seed=13, n=3, logprobs=True, top_logprobs=1),
    # vLLM's sampling fields: the prefill node's first token obeys them as the decode node's rest
    **{f"field-{name}": req for name, req in SAMPLING_FIELDS.items()},
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", list(REQUESTS))
def test_reply_equals_colocated(cluster: dict[str, Proc], name: str, order: str) -> None:
    expected, got = both_paths(cluster, order, *REQUESTS[name])
    assert expected.status_code == 200, expected.text
    assert got.status_code == 200, got.text
    assert_same(expected.json(), got.json())


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", list(REQUESTS))
def test_stream_equals_colocated_chunk_by_chunk(cluster: dict[str, Proc], name: str, order: str) -> None:
    path, body = REQUESTS[name]
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    expected = stream_events(cluster["both"], path, body)
    assert_same(expected, stream_events(cluster[order], path, body))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", ["greedy-logprobs", "chat-seeded"])
def test_continuous_usage_stream_equals_colocated(cluster: dict[str, Proc], name: str, order: str) -> None:
    path, body = REQUESTS[name]
    body = {**body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    expected = stream_events(cluster["both"], path, body)
    assert all(e["usage"] for e in expected[:-1])  # vLLM's meaning: the usage so far on every chunk
    assert_same(expected, stream_events(cluster[order], path, body))


def test_streams_carry_one_token_per_chunk(cluster: dict[str, Proc]) -> None:
    path, body = REQUESTS["greedy-logprobs"]
    events = stream_events(cluster["concurrent"], path, {**body, "stream": True})
    token_chunks = [e for e in events[:-1] if e["choices"] and e["choices"][0]["logprobs"]]
    assert [len(e["choices"][0]["logprobs"]["tokens"]) for e in token_chunks] == [1] * 12


def test_logprobs_are_present_at_every_position(cluster: dict[str, Proc]) -> None:
    path, body = REQUESTS["seeded-top-p-top-k-logprobs"]
    logprobs = post(cluster["prefill_first"], path, body).json()["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(logprobs["tokens"]) > 0
    assert all(isinstance(lp, float) for lp in logprobs["token_logprobs"])
    assert all(len(top) >= 2 for top in logprobs["top_logprobs"])


def _without(body: dict, name: str) -> dict:
    fields = {"presence-penalty": ("presence_penalty",), "frequency-penalty": ("frequency_penalty",),
              "min-p": ("min_p",), "top-k": ("top_k",), "logit-bias": ("logit_bias", "frequency_penalty"),
              "min-tokens": ("min_tokens",)}.get(name)
    drop = fields or [k for k in body if k.endswith("_penalty") or k in ("min_p", "top_k", "logit_bias")]
    return {k: v for k, v in body.items() if k not in drop}


@pytest.mark.parametrize("name", list(SAMPLING_FIELDS))
def test_each_sampling_field_changes_the_answer(cluster: dict[str, Proc], name: str) -> None:
    """So the parity above is not vacuous: without the field the colocated node answers otherwise."""
    path, body = SAMPLING_FIELDS[name]
    with_field, without = (post(cluster["both"], path, b).json()["choices"][0] for b in (body, _without(body, name)))
    assert with_field.get("text", with_field.get("message")) != without.get("text", without.get("message"))


def test_chat_top_logprobs_are_exactly_n(cluster: dict[str, Proc]) -> None:
    """OpenAI's count: N entries even where the sampled token is not among them (it keeps its own
    ``logprob``); completions' ``logprobs: N`` adds the sampled token as vLLM does (up to N+1)."""
    path, body = chat(temperature=2.0, seed=5, max_tokens=40, logprobs=True, top_logprobs=1, ignore_eos=True)
    for proc in (cluster["both"], cluster["concurrent"]):
        content = post(proc, path, body).json()["choices"][0]["logprobs"]["content"]
        assert [len(entry["top_logprobs"]) for entry in content] == [1] * 40
        outside = [e for e in content if e["top_logprobs"][0]["token"] != e["token"]]
        assert outside and all(e["logprob"] < e["top_logprobs"][0]["logprob"] for e in outside)
    path, body = completion(temperature=2.0, seed=5, max_tokens=40, logprobs=1, ignore_eos=True)
    logprobs = post(cluster["both"], path, body).json()["choices"][0]["logprobs"]
    assert all(token in top and len(top) <= 2 for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"]))
    assert max(len(top) for top in logprobs["top_logprobs"]) == 2


BAD_REQUESTS = {
    "max-tokens-negative": completion(max_tokens=-1),
    "temperature-too-high": completion(temperature=5.0),
    "top-p-zero": completion(top_p=0.0),
    "logprobs-too-many": completion(logprobs=30),
    "min-tokens-above-max": completion(min_tokens=20, max_tokens=5),
    "min-tokens-negative": completion(min_tokens=-1),
    "max-tokens-a-string": completion(max_tokens="5"),
    "prompt-missing": ("/v1/completions", {"model": MODEL, "max_tokens": 3}),
    "prompt-empty": completion(prompt=""),
    "context-too-long": completion(prompt=[5] * 4100, max_tokens=4),
    "token-outside-vocab": completion(prompt=[5, 10**7]),
    "n-past-max": completion(n=17),
    "wrong-model": completion(model="no-such-model"),
    "chat-messages-missing": ("/v1/chat/completions", {"model": MODEL}),
    "chat-top-logprobs-without-logprobs": chat(top_logprobs=2),
    "chat-top-logprobs-false": chat(logprobs=False, top_logprobs=0),
    "presence-penalty-too-high": completion(presence_penalty=2.5),
    "repetition-penalty-zero": completion(repetition_penalty=0),
    "min-p-above-one": completion(min_p=1.5),
    "logit-bias-outside-vocab": completion(logit_bias={"2048": 1}),
    "logit-bias-too-strong": chat(logit_bias={"5": -101}),
    "top-k-minus-two": chat(top_k=-2),
    "not-json": ("/v1/completions", b"{not json"),
    "empty-body": ("/v1/completions", b""),
    "nested-too-deep": ("/v1/completions", b'{"prompt": ' + b"[" * 100 + b"]" * 100 + b"}"),
    "over-4-mib": ("/v1/completions", b'{"prompt": "' + b"x" * (4 << 20) + b'"}'),  # 413 on both
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_error_equals_colocated(cluster: dict[str, Proc], name: str, order: str) -> None:
    expected, got = both_paths(cluster, order, *BAD_REQUESTS[name])
    assert 400 <= expected.status_code < 500, expected.text
    assert (got.status_code, got.json()) == (expected.status_code, expected.json())


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("method, path", [("GET", "/v1/nothing-here"), ("GET", "/v1/completions")])
def test_unknown_route_and_method_equal_colocated(cluster: dict[str, Proc], order: str, method: str,
                                                  path: str) -> None:
    expected = httpx.request(method, cluster["both"].url + path, timeout=10)
    got = httpx.request(method, cluster[order].url + path, timeout=10)
    assert (got.status_code, got.json()) == (expected.status_code, expected.json())
