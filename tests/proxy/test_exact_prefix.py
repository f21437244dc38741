"""Exact prefix routing: the proxy tokenizes a prompt as the node does, names its blocks with each
node's chain root and salt, and picks the node whose KV events say it holds the longest run of
them; a node whose events cannot say counts as caching nothing."""

from __future__ import annotations

from collections import Counter

import pytest

from common.engine.block_hash import extend_hashes, salted_root
from common.model.embedded import ensure_embedded_model
from common.model.tokenizer import Tokenizer
from common.registry_client import RegistrationMessage
from common.serving.chat import chat_prompt_token_ids
from common.serving.completions import prompt_token_ids
from common.serving.protocol import ChatCompletionRequest
from proxy.disagg import DisaggPolicy
from proxy.exact_prefix import ExactPrefix, PromptTokens
from proxy.kv_index import KVIndex
from proxy.prefix_policy import PromptText
from proxy.registry import ServiceRegistry
from proxy.routing import Router

ROOT = b"r" * 16
D1, D2 = ("D", "127.0.0.1:8201"), ("D", "127.0.0.1:8202")


def node(key: tuple[str, str], root: bytes = ROOT) -> RegistrationMessage:
    return RegistrationMessage(type=key[0], http_address=key[1], zmq_address=f"{key[1][:-4]}{int(key[1][-4:]) + 1000}",
                               model="m", kv_fingerprint="f", block_size=4, num_running=0, num_waiting=0,
                               kv_events={"endpoint": "127.0.0.1:1", "replay": "127.0.0.1:2",  # type: ignore[arg-type]
                                          "epoch": "ab" * 8, "seq": 0, "root": root.hex()})


def chain(tokens: list[int], salt: str | None = None, root: bytes = ROOT) -> list[bytes]:
    out: list[bytes] = []
    extend_hashes(out, salted_root(root, salt), lambda s, e: tokens[s:e], 4, len(tokens) // 4)
    return out


def test_routes_to_the_node_holding_the_prompts_blocks() -> None:
    registry, index = ServiceRegistry(port=0), KVIndex()
    p = ("P", "127.0.0.1:8101")
    for key in (p, D1, D2):
        registry.register(node(key))
        index.set_fresh(key, True)
    router = Router(registry, "prefix_aware", exact=ExactPrefix(index))
    routes: Counter = Counter()
    router.on_route = lambda role, reason: routes.update([(role, reason)])
    tokens = list(range(100, 120))  # 5 blocks of 4
    index.stored(D2, chain(tokens)[:3])
    pair = router.pick("m", prompt=PromptText("text", None, tokens))
    assert pair.decode.http_address == D2[1] and routes == {("prefill", "load"): 1, ("decode", "prefix_events"): 1}
    routes.clear()
    index.set_fresh(D2, False)  # its events stopped: its cache is unknown, never counted
    index.stored(D1, chain(tokens)[:1])
    assert router.pick("m", prompt=PromptText("text", None, tokens)).decode.http_address == D1[1]
    assert routes[("decode", "prefix_events")] == 1
    routes.clear()
    assert router.pick("m", prompt=PromptText("text", "tenant-b", tokens))  # another salt: another chain
    assert routes[("decode", "load")] == 1


def test_prompt_tokens_without_a_tokenizer_are_the_ids_given() -> None:
    tokens = PromptTokens(None)
    assert tokens.token_ids({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert tokens.token_ids({"prompt": [[4, 5], [6]]}) == [4, 5]
    assert tokens.token_ids({"prompt": "text"}) is None and tokens.token_ids({"prompt": [1, "x"]}) is None
    prompt = tokens.prompt({"prompt": [7, 8], "cache_salt": "s"})
    assert prompt.token_ids == [7, 8] and prompt.cache_salt == "s"


def test_exact_counts_need_a_fresh_node() -> None:
    index = KVIndex()
    exact = ExactPrefix(index)
    tokens = list(range(8))
    index.stored(D1, chain(tokens))
    nodes = [node(D1), node(D2, root=b"x" * 16)]
    assert exact.cached_tokens(nodes, PromptText("t", None, tokens)) is None  # nobody fresh: the estimate decides
    index.set_fresh(D1, True)
    index.set_fresh(D2, True)
    assert exact.cached_tokens(nodes, PromptText("t", None, tokens)) == {D1: 8, D2: 0}
    assert exact.cached_tokens(nodes, "no token ids") is None


MESSAGES = [{"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": [{"type": "text", "text": "Which "}, {"type": "text", "text": "colour?"}]}]


@pytest.mark.parametrize("body", [{"prompt": "Once upon a time, a cache."}, {"prompt": ["first one", "second"]},
                                  {"messages": MESSAGES}])
def test_the_proxy_tokenizes_as_the_node_does(body: dict) -> None:
    model = ensure_embedded_model()
    node_tokenizer = Tokenizer.from_dir(model)
    if "messages" in body:
        node = chat_prompt_token_ids(node_tokenizer, ChatCompletionRequest.model_validate({"model": "m", **body}))
    else:
        node = prompt_token_ids(node_tokenizer, body["prompt"])[0]
    assert PromptTokens(str(model)).token_ids(body) == node


def test_a_body_the_proxy_cannot_render_has_no_token_ids() -> None:
    tokens = PromptTokens(str(ensure_embedded_model()))
    assert tokens.token_ids({"messages": MESSAGES, "tools": [{"type": "function"}]}) is None
    assert tokens.token_ids({"messages": [{"role": "user"}]}) is None
    assert tokens.token_ids({"messages": [{"role": "user", "content": 5}]}) is None


def test_disagg_auto_uses_the_exact_counts() -> None:
    """A 2,560-token prompt D holds by its events is prefilled there (its last block's worth); once D's
    events stop, D counts as holding nothing, whatever this proxy sent it, and P prefills it."""
    figures = {"prefill_tokens_per_s": 2000.0, "pending_prefill_tokens": 0, "kv_bytes_per_token": 4096.0}
    p = RegistrationMessage(**{**node(("P", "127.0.0.1:8101")).to_dict(), **figures})
    d = RegistrationMessage(**{**node(D1).to_dict(), **figures, "num_decoding": 0, "max_local_prefill_stall_ms": 50.0,
                               "kv_transfer_bytes_per_s": 4e9})
    index = KVIndex()
    policy = DisaggPolicy("auto")
    policy.exact = ExactPrefix(index)
    tokens = [7 + i % 200 for i in range(2560)]
    prompt = PromptText("a long prompt", None, tokens)
    for key in (("P", p.http_address), D1):
        index.set_fresh(key, True)
    index.stored(D1, chain(tokens)[:-1])  # all but the last block
    assert (policy.decide(p, d, prompt).path, policy.decide(p, d, prompt).reason) == ("local", "cheaper_local")
    index.set_fresh(D1, False)
    policy.sent(policy.decide(p, d, prompt), p, d, prompt)  # the text memory now says D has it: not used
    assert (policy.decide(p, d, prompt).path, policy.decide(p, d, prompt).reason) == ("remote", "stall_bound")


def test_tier_blocks_count_at_their_measured_load_cost() -> None:
    """A node's blocks in a KV tier (events with a medium) count after its pool's run, weighted by
    1 - load time / prefill time per token from its heartbeat; without those figures, not at all."""
    index, tokens = KVIndex(), list(range(100, 124))  # 6 blocks of 4
    index.set_fresh(D1, True)
    hashes = chain(tokens)
    index.stored(D1, hashes[:2])
    index.tier("DISK").stored(D1, hashes[2:4])
    index.tier("CPU").stored(D1, hashes[4:5])
    assert index.tier("OTHER") is None  # a medium we cannot weigh is never indexed
    prompt = PromptText("text", None, tokens)
    unmeasured = node(D1)
    assert ExactPrefix(index).cached_tokens([unmeasured], prompt) == {D1: 8}
    # prefill 1,000 tokens/s (1 ms a token); a token's KV is 1,000 bytes: DISK at 4 MB/s loads it in
    # 0.25 ms (worth 0.75 of a token), CPU at 1 GB/s in 1 us (worth 0.999)
    measured = RegistrationMessage(**{**unmeasured.__dict__, "prefill_tokens_per_s": 1000.0,
                                      "kv_bytes_per_token": 1000.0,
                                      "kv_tier_load_bytes_per_s": {"DISK": 4e6, "CPU": 1e9}})
    assert ExactPrefix(index).cached_tokens([measured], prompt) == {D1: 8 + round((2 * 0.75 + 0.999) * 4)}
    slow = RegistrationMessage(**{**measured.__dict__, "kv_tier_load_bytes_per_s": {"DISK": 1e5}})
    assert ExactPrefix(index).cached_tokens([slow], prompt) == {D1: 8}  # loading costs more than computing
    index.cleared(D1)
    assert ExactPrefix(index).cached_tokens([measured], prompt) == {D1: 0}
