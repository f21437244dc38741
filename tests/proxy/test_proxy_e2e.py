"""The real openai client -> proxy -> prefill daemon -> decode daemon, all real processes.

The daemons register with the proxy over ZMQ; greedy answers through the proxy equal
a colocated node's, for chat and completions, streaming and not.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from helpers.cluster import Proc, metric, start, wait_idle
from helpers.waiting import wait_until


@pytest.fixture
def cluster(shared_cluster: dict[str, Proc]) -> dict[str, Proc]:
    return shared_cluster  # its proxy is the daemons' registry, on default flags (a 6 s heartbeat timeout)


def _client(proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=60)


GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "What does the with statement do?"}]


def test_models_lists_the_registered_model(cluster) -> None:
    models = _client(cluster["proxy"]).models.list()
    assert [m.id for m in models.data] == ["pdserve-tiny"]
    node = httpx.get(cluster["decode"].url + "/v1/models").json()["data"][0]
    assert models.data[0].max_model_len == node["max_model_len"] > 0  # type: ignore[attr-defined]


def test_chat_through_the_proxy_matches_colocated(cluster) -> None:
    expected = _client(cluster["both"]).chat.completions.create(model="pdserve-tiny", messages=MESSAGES, **GREEDY)
    got = _client(cluster["proxy"]).chat.completions.create(model="pdserve-tiny", messages=MESSAGES, **GREEDY)
    assert got.choices[0].message.content == expected.choices[0].message.content
    assert got.usage.completion_tokens == expected.usage.completion_tokens == 12
    assert got.id.startswith("chatcmpl-") and "prefill_addr" not in got.id  # the tag stays between proxy and nodes

    stream = _client(cluster["proxy"]).chat.completions.create(
        model="pdserve-tiny", messages=MESSAGES, stream=True, **GREEDY)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == expected.choices[0].message.content


def test_completions_through_the_proxy_match_colocated(cluster) -> None:
    prompt = "The quick brown fox"
    expected = _client(cluster["both"]).completions.create(model="pdserve-tiny", prompt=prompt, **GREEDY)
    got = _client(cluster["proxy"]).completions.create(model="pdserve-tiny", prompt=prompt, **GREEDY)
    assert got.choices[0].text == expected.choices[0].text
    stream = _client(cluster["proxy"]).completions.create(model="pdserve-tiny", prompt=prompt, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected.choices[0].text


def test_bad_request_through_the_proxy_is_a_400(cluster) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _client(cluster["proxy"]).completions.create(model="pdserve-tiny", prompt="hi", max_tokens=-1)
    assert "max_tokens" in str(err.value)


def test_metrics_and_idle_after_traffic(cluster) -> None:
    _client(cluster["proxy"]).completions.create(model="pdserve-tiny", prompt="hello", **GREEDY)
    for role in ("prefill", "decode"):
        wait_idle(cluster[role].url)
        assert metric(cluster[role].url, "pdserve:generation_tokens_total") > 0
    text = httpx.get(cluster["proxy"].url + "/metrics").text
    assert 'pdserve:registered_nodes{role="proxy",type="P"} 1.0' in text
    assert 'pdserve:registered_nodes{role="proxy",type="D"} 1.0' in text


def test_proxy_log_lines_name_the_node_and_the_request(cluster) -> None:
    proxy = cluster["proxy"]
    got = _client(proxy).completions.create(model="pdserve-tiny", prompt="logged", **GREEDY)
    # The same "[node] [request id]" prefix as the daemons' lines, so one grep for the id finds them all.
    marker = f"[proxy:127.0.0.1:{proxy.port}] [{got.id}]"

    def finished_lines() -> list[str]:  # the request's line once it is answered (debug lines come before)
        return [ln for ln in proxy.log.read_text(errors="replace").splitlines() if marker in ln and "status=" in ln]

    wait_until(finished_lines, "the proxy logs the answered request", 30, step=0.1)
    first_line = proxy.log.read_text(errors="replace").splitlines()[0]  # uvicorn's own start-up lines too
    assert f" [proxy:127.0.0.1:{proxy.port}] " in first_line, first_line
    (line,) = finished_lines()
    assert "status=200" in line and "P=" in line and "D=" in line


def test_a_dead_decode_node_is_evicted(cluster, tmp_path) -> None:
    registry = f"127.0.0.1:{cluster['proxy'].kv_port}"
    extra = start("decode", tmp_path, "--proxy", registry, "--heartbeat-interval-s", "0.5", name="decode-extra")
    try:
        extra.kill()
        def one_decode_node() -> bool:
            text = httpx.get(cluster["proxy"].url + "/metrics").text
            return any(ln.startswith("pdserve:registered_nodes") and 'type="D"' in ln and ln.endswith(" 1.0")
                       for ln in text.splitlines())

        # the sweep drops it after the heartbeat timeout; requests keep working meanwhile
        wait_until(one_decode_node, "the dead node evicted", 15, step=0.5)
    finally:
        extra.kill()
    got = _client(cluster["proxy"]).completions.create(model="pdserve-tiny", prompt="after", **GREEDY)
    assert got.usage.completion_tokens == 12
