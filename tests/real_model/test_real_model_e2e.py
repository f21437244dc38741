"""The product on the real default model (SmolLM2-135M-Instruct), through real processes.

One cluster for the module: a proxy (prefill -> decode always, so every request crosses the KV
path), one prefill and two decode daemons, and a colocated node started as a newcomer starts one:
no --model at all. The model is fetched and converted once per machine (conftest's
``real_model``). Greedy answers are checked against transformers running the same GGUF.
"""

from __future__ import annotations

import functools
import json
import re
import threading

import httpx
import pytest
import torch

from common.defaults import DEFAULT_MODEL_NAME
from common.model.tokenizer import Tokenizer
from helpers.cluster import Proc, metric, start, stop_all, wait_idle
from helpers.waiting import wait_until

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CHAT_PROMPTS = ["What is the capital of France?", "Explain how a rainbow forms.", "Give me three tips for sleeping well.",
                "Write a short story about a cat."]
COMPLETION_PROMPTS = ["The capital of Germany is", "Once upon a time, in a small village,", "def fibonacci(n):",
                      "The three primary colours are"]
STEPS = 32


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, real_model, newcomer_env):
    tmp = tmp_path_factory.mktemp("real-model")
    model_args = ("--model", str(real_model.directory), "--served-model-name", DEFAULT_MODEL_NAME)
    procs: dict[str, Proc] = {}
    try:
        # the migration drill kills a decode node (its stream breaks at once); the timeouts leave room for
        # a loaded machine: the survivor's heartbeats may lag, and its re-prefill of prompt + output may be slow
        procs["proxy"] = start("proxy", tmp, "--disagg-policy", "always", "--heartbeat-timeout-s", "5",
                               "--migration-limit", "2", "--stream-idle-timeout-s", "20", wait=False)
        registry = ("--proxy", f"127.0.0.1:{procs['proxy'].kv_port}", "--heartbeat-interval-s", "0.5")
        for name, role in (("prefill", "prefill"), ("decode1", "decode"), ("decode2", "decode")):
            procs[name] = start(role, tmp, *registry, *model_args, name=name, wait=False)
        with newcomer_env():  # `pdserve serve` with no --model: the default model, as the README says
            procs["both"] = start("both", tmp, wait=False)
        for proc in procs.values():
            proc.wait_ready(timeout=180)
        yield procs
    finally:
        stop_all(procs.values())


@pytest.fixture(scope="module")
def reference(real_model):
    """transformers on the GGUF itself, and our tokenizer (the prompts' ids come from it, as the server's do)."""
    import gguf
    import transformers

    path = real_model.gguf
    # transformers parses the file twice (config, then weights) and builds gguf's tensor-name map once
    # per tensor, ~10 s here: both are pure functions of their arguments, so each runs once (the same
    # weights to the bit; 10.7 s -> 6.2 s)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32)
    return model.eval(), Tokenizer.from_dir(real_model.directory)


def check_greedy(model, ids: list[int], tokens: list[int], tops: list[list[float]]) -> None:
    """``tokens`` are transformers' greedy tokens after ``ids`` and ``tops`` its 5 best logprobs (1e-3).

    One forward over prompt + answer: each answer token must be transformers' argmax given the tokens
    before it, which by induction is transformers' own greedy sequence (transformers' generate takes
    ~0.3 s a token here, a forward over the whole answer less than one)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1].float()
    logprobs = torch.log_softmax(logits, -1)
    assert logprobs.argmax(-1).tolist() == tokens
    for step, ours in enumerate(tops):
        theirs = logprobs[step].topk(5).values.tolist()
        if len(ours) == 5:  # two tokens decoding to the same text share one key in completions' map
            assert max(abs(a - b) for a, b in zip(sorted(ours, reverse=True), theirs)) <= 1e-3, step


def post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(url + path, json={"model": DEFAULT_MODEL_NAME, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def chat(url: str, content: str, **extra) -> dict:
    return post(url, CHAT, {"messages": [{"role": "user", "content": content}], "temperature": 0, **extra})


def test_the_readme_question_is_answered(cluster) -> None:
    answer = chat(cluster["proxy"].url, "What is the capital of France?", max_tokens=32)
    assert "Paris" in answer["choices"][0]["message"]["content"]
    models = httpx.get(cluster["both"].url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [DEFAULT_MODEL_NAME]  # the node started with no --model


@pytest.mark.parametrize("node", ["proxy", "both"], ids=["prefill-decode", "colocated"])
@pytest.mark.parametrize("api", ["chat", "completion"])
def test_greedy_tokens_and_logprobs_equal_transformers(cluster, reference, node, api) -> None:
    model, tok = reference
    url = cluster[node].url
    prompts = CHAT_PROMPTS if api == "chat" else COMPLETION_PROMPTS
    for prompt in prompts:
        if api == "chat":
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))
            got = chat(url, prompt, max_tokens=STEPS, logprobs=True, top_logprobs=5)
            text = got["choices"][0]["message"]["content"]
            tops = [[t["logprob"] for t in entry["top_logprobs"]] for entry in got["choices"][0]["logprobs"]["content"]]
        else:
            ids = tok.encode(prompt)
            got = post(url, COMPLETIONS, {"prompt": prompt, "max_tokens": STEPS, "temperature": 0, "logprobs": 5})
            text = got["choices"][0]["text"]
            tops = [list(top.values()) for top in got["choices"][0]["logprobs"]["top_logprobs"]]
        # The answer's ids: its text encoded again (a greedy answer is spelled as the tokenizer spells it),
        # and the EOS that ended it, which the text does not show.
        ended = got["choices"][0]["finish_reason"] == "stop"
        tokens = tok.encode(text, add_special_tokens=False) + (tok.eos_token_ids[:1] if ended else [])
        assert len(tokens) == got["usage"]["completion_tokens"] == len(tops), prompt
        check_greedy(model, ids, tokens, tops)


def test_json_schema_output_is_words(cluster) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                "country": {"type": "string", "maxLength": 40}},
              "required": ["city", "country"], "additionalProperties": False}
    answer = chat(cluster["proxy"].url, "Give the capital of France as JSON with keys city and country.",
                  max_tokens=64, response_format={"type": "json_schema", "json_schema": {"name": "place",
                                                                                           "schema": schema}})
    value = json.loads(answer["choices"][0]["message"]["content"])
    assert set(value) == {"city", "country"}
    for text in value.values():
        assert re.fullmatch(r"[A-Za-z][A-Za-z .,'-]*", text), value  # words, not byte soup
    assert "Paris" in value["city"] or "France" in value["country"]


def test_second_turn_reuses_the_cache_and_answers_as_without_it(cluster) -> None:
    url = cluster["proxy"].url
    history = [{"role": "user", "content": "What is the capital of France?"}]
    first = post(url, CHAT, {"messages": history, "temperature": 0, "max_tokens": 24, "cache_salt": "turns"})
    history += [first["choices"][0]["message"], {"role": "user", "content": "And of Italy?"}]
    second = post(url, CHAT, {"messages": history, "temperature": 0, "max_tokens": 24, "cache_salt": "turns"})
    cold = post(url, CHAT, {"messages": history, "temperature": 0, "max_tokens": 24, "cache_salt": "cold"})
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    assert "Rome" in second["choices"][0]["message"]["content"]


def test_stop_string_eos_and_length_end_with_their_finish_reason(cluster) -> None:
    url = cluster["proxy"].url
    stopped = chat(url, "What is the capital of France?", max_tokens=32, stop=["Paris"])["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["message"]["content"] == "The capital of France is "
    natural = chat(url, "What is the capital of France?", max_tokens=64)
    assert natural["choices"][0]["finish_reason"] == "stop" and natural["usage"]["completion_tokens"] < 64
    assert natural["choices"][0]["message"]["content"].endswith("Paris.")  # EOS, not shown as text
    cut = chat(url, "What is the capital of France?", max_tokens=3)
    assert cut["choices"][0]["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == 3


def test_n_seeded_samples_differ_and_equal_the_colocated_node(cluster) -> None:
    body = {"messages": [{"role": "user", "content": "Write a short poem about rain."}], "n": 3, "seed": 11,
            "temperature": 1.0, "max_tokens": 24}
    through = [c["message"]["content"] for c in post(cluster["proxy"].url, CHAT, body)["choices"]]
    local = [c["message"]["content"] for c in post(cluster["both"].url, CHAT, body)["choices"]]
    assert len(set(through)) == 3
    assert through == local


def test_a_migrated_stream_completes_with_the_same_text(cluster) -> None:
    """Last in the module: it kills a decode node."""
    url = cluster["proxy"].url
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "The history of Paris begins", "max_tokens": 96,
            "temperature": 0, "ignore_eos": True}
    want = post(url, COMPLETIONS, body)["choices"][0]["text"]
    chunks: list[str] = []
    first = threading.Event()
    failures: list[BaseException] = []

    def read() -> None:
        try:
            with httpx.stream("POST", url + COMPLETIONS, json=body | {"stream": True}, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        assert "error" not in event, event
                        chunks.append("".join(c.get("text") or "" for c in event["choices"]))
                        first.set()
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)
        finally:
            first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert first.wait(60)
    decoders = [cluster["decode1"], cluster["decode2"]]
    running: list[Proc] = []
    wait_until(lambda: running.extend(d for d in decoders if metric(d.url, "pdserve:num_requests_running") >= 1)
               or running, "a decode node runs the stream")
    serving = running[0]
    serving.kill()
    reader.join(timeout=120)
    assert not failures, failures
    assert "".join(chunks) == want
    survivor = next(d for d in decoders if d is not serving)
    wait_idle(survivor.url, timeout=30)
