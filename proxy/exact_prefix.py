"""A prompt's cached prefix on each node, exactly: its blocks named as the nodes name them, looked up
in the index of their KV events (``proxy/kv_index.py``).

Why the proxy tokenizes. An engine names a full block by a hash chain over its token ids
(common/engine/block_hash.py), so matching a prompt against what a node stored needs the prompt's
token ids -- the text the proxy sees does not give them. vLLM's router and llm-d tokenize in the
router for this; so does this proxy, with the model's own tokenizer and chat template
(``--tokenizer DIR``: the model directory the nodes load, or one with the same tokenizer files;
``tokenizers`` and ``jinja2`` are already dependencies). The chain's root (the node's model and
block size) and its block size come in each node's heartbeat (``kv_events.root``,
``block_size``), and the request's ``cache_salt`` salts it as the engine does, so the hashes here
are the node's own. A prompt given as token ids needs no tokenizer.

Blocks a node keeps in a KV tier behind its pool (host memory, files; the events' ``medium``) count
at what they save: a tier hit of ``t`` tokens counts ``t x max(0, 1 - load / compute)``, ``load``
the tier's measured load time for a token's KV (``kv_bytes_per_token / kv_tier_load_bytes_per_s``
from its heartbeat) and ``compute`` the node's measured prefill time for a token. A node that has
not measured either yet gets nothing for its tier blocks: they are never counted as pool hits.

What can go wrong costs speed, never an answer: tokens that differ from the node's (another
tokenizer, a chat request the proxy renders differently -- one with tools is not tried) match
nothing, and the request goes by load; the node computes what it lacks. Without ``--tokenizer``
(or for a body it cannot tokenize) prefix routing keeps its text estimate (proxy/prefix_policy.py).
"""

from __future__ import annotations

import logging
from typing import Any

from common.engine.block_hash import extend_hashes, salted_root
from common.model.tokenizer import Tokenizer
from common.registry_client import RegistrationMessage
from proxy.kv_index import KVIndex, NodeKey
from proxy.prefix_policy import PromptText, prompt_text

logger = logging.getLogger(__name__)
MAX_TOKEN_IDS = 1 << 20


class PromptTokens:
    """The routing prompt of a body: its text (the estimate's) carrying its token ids when known."""

    def __init__(self, tokenizer_dir: str | None) -> None:
        self.tokenizer = Tokenizer.from_dir(tokenizer_dir) if tokenizer_dir else None

    def prompt(self, body: dict, tokenize: bool = True) -> str:
        """``tokenize`` False: the text alone (no node's events could use the ids: 0.3-0.4 ms of
        tokenizing a few hundred tokens saved per request)."""
        text = prompt_text(body)
        ids = self.token_ids(body) if tokenize else None
        if ids is None:
            return text
        return PromptText(text, getattr(text, "cache_salt", None), ids)

    def token_ids(self, body: dict) -> list[int] | None:
        """The prompt's token ids as a node computes them, or None when this proxy cannot tell."""
        prompt, messages = body.get("prompt"), body.get("messages")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # several prompts: the first one routes
        if isinstance(prompt, list):
            ok = len(prompt) <= MAX_TOKEN_IDS and all(type(t) is int for t in prompt)
            return prompt if ok else None
        if self.tokenizer is None:
            return None
        try:
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt, add_special_tokens=True)
            if isinstance(messages, list) and messages and not body.get("tools"):
                rendered = self.tokenizer.apply_chat_template([_plain(m) for m in messages], add_generation_prompt=True)
                return self.tokenizer.encode(rendered, add_special_tokens=False)
        except Exception:  # noqa: BLE001 - any message the proxy cannot render routes by the estimate
            return None
        return None


def _plain(message: Any) -> dict:
    """What the node hands its chat template (``ChatMessage.as_template_input``); raises on anything else."""
    content = message["content"]
    if isinstance(content, list):
        content = "".join(part["text"] for part in content)
    if not isinstance(message["role"], str) or not isinstance(content, (str, type(None))):
        raise TypeError("not a plain text message")
    return {"role": message["role"], "content": content or ""}


class ExactPrefix:
    """Cached prompt tokens per node from the index, or None when no node's events can say."""

    def __init__(self, index: KVIndex) -> None:
        self.index = index

    def cached_tokens(self, nodes: list[RegistrationMessage], prompt: str) -> dict[NodeKey, int] | None:
        """For each node, the prompt tokens it holds as leading full blocks (0 for a cache-unknown
        node); None when the prompt has no token ids or no node of ``nodes`` has fresh events."""
        tokens = getattr(prompt, "token_ids", None)
        keys = [(n.type, n.http_address) for n in nodes]
        if tokens is None or not self.index.any_fresh(keys):
            return None
        salt = getattr(prompt, "cache_salt", None)
        out = dict.fromkeys(keys, 0)
        chains: dict[tuple[str, int], list[NodeKey]] = {}
        by_key = dict(zip(keys, nodes))
        for node, key in zip(nodes, keys):
            if node.kv_events is not None and node.block_size and self.index.is_fresh(key):
                chains.setdefault((node.kv_events.root, node.block_size), []).append(key)
        for (root, block_size), members in chains.items():
            hashes: list[bytes] = []
            extend_hashes(hashes, salted_root(bytes.fromhex(root), salt), lambda s, e: tokens[s:e], block_size,
                          len(tokens) // block_size)
            for key, blocks in self.index.leading(members, hashes).items():
                out[key] = blocks * block_size
                worth = tier_worth(by_key[key])
                if worth:
                    out[key] += round(self._tier_blocks(key, hashes[blocks:], worth) * block_size)
        return out

    def _tier_blocks(self, key: NodeKey, hashes: list[bytes], worth: dict[str, float]) -> float:
        """The blocks after the pool's run that ``key``'s tiers hold, in order, each weighted by its tier's worth."""
        held = {medium: index.held(key, hashes) for medium, index in self.index.tiers().items() if medium in worth}
        total = 0.0
        for i in range(len(hashes)):
            medium = next((m for m, flags in held.items() if flags[i]), None)
            if medium is None:
                break
            total += worth[medium]
        return total


def tier_worth(node: RegistrationMessage) -> dict[str, float]:
    """Per tier medium, the share of a token's prefill a hit in it saves ``node`` (0..1), from its heartbeat."""
    rates, per_s, per_token = node.kv_tier_load_bytes_per_s, node.prefill_tokens_per_s, node.kv_bytes_per_token
    if not rates or not per_s or not per_token:
        return {}
    compute = 1.0 / per_s
    return {medium: max(0.0, 1.0 - per_token / rate / compute) for medium, rate in rates.items()}
