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

The peer tier (``--kv-peer-fetch on``, issue 35): a node running it fetches prefix blocks it lacks
from another node running it. On the leg that computes the prompt (the prefill leg; the decode leg
of a local prefill) the proxy adds ``"pdserve_peer_prefix": {"kv_addr", "blocks"}`` when the target
runs it, its events are fresh, and another such node of its model, layout and chain (one the
registry names in the target's ``peers``) holds more leading blocks in its pool than the target in
pool and tiers: ``kv_addr`` is the best holder's KV address (most blocks, ties the least loaded),
``blocks`` its leading pool blocks. A client's own field of that name is removed (proxy/relay.py).
In routing, a peer fetcher counts the best holder's blocks beyond its own at the PEER worth of its
heartbeat (``kv_tier_load_bytes_per_s["PEER"]``, weighed as a tier: 0 while unmeasured).

What can go wrong costs speed, never an answer: tokens that differ from the node's (another
tokenizer, a chat request the proxy renders differently -- one with tools is not tried) match
nothing, and the request goes by load; the node computes what it lacks. Without ``--tokenizer``
(or for a body it cannot tokenize) prefix routing keeps its text estimate (proxy/prefix_policy.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.engine.block_hash import extend_hashes, salted_root
from common.model.tokenizer import Tokenizer
from common.registry_client import RegistrationMessage
from proxy.kv_index import KVIndex, NodeKey
from proxy.prefix_policy import PromptText, prompt_text

logger = logging.getLogger(__name__)
MEDIUM_HOST = "CPU"  # the host tier's KV-event medium (common/engine/kv_tiers.py)
MEDIUM_DISK = "DISK"  # the file tier's
MAX_TOKEN_IDS = 1 << 20
PEER_PREFIX_FIELD = "pdserve_peer_prefix"  # the hint's body field; only the proxy sets it
MEDIUM_PEER = "PEER"  # the peer tier's key in a heartbeat's kv_tier_load_bytes_per_s


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
    """Cached prompt tokens per node from the index, or None when no node's events can say; and the
    peer hint for the node that will compute a prompt (``--kv-peer-fetch``)."""

    def __init__(self, index: KVIndex,
                 peer_fetchers: Callable[[], list[RegistrationMessage]] = list) -> None:
        self.index = index
        self.peer_fetchers = peer_fetchers  # the registry's routable nodes running --kv-peer-fetch on

    def cached_tokens(self, nodes: list[RegistrationMessage], prompt: str) -> dict[NodeKey, int] | None:
        """For each node, the prompt tokens it holds as leading full blocks (0 for a cache-unknown
        node); None when the prompt has no token ids or no node of ``nodes`` has fresh events."""
        tokens = getattr(prompt, "token_ids", None)
        keys = [_key(n) for n in nodes]
        if tokens is None or not self.index.any_fresh(keys):
            return None
        out = dict.fromkeys(keys, 0)
        chains: dict[tuple[str, int], list[RegistrationMessage]] = {}
        for node, key in zip(nodes, keys):
            if node.kv_events is not None and node.block_size and self.index.is_fresh(key):
                chains.setdefault((node.kv_events.root, node.block_size), []).append(node)
        for (root, block_size), members in chains.items():
            hashes = _chain(prompt, root, block_size)
            # a peer fetcher's reach counts only at a measured PEER worth
            fetching = [n for n in members if n.kv_peer_fetch and tier_worth(n).get(MEDIUM_PEER)]
            holders = self._holders(root, block_size) if fetching else []
            counts = self.index.leading(list(dict.fromkeys([*map(_key, members), *map(_key, holders)])), hashes)
            for node in members:
                key, blocks, worth = _key(node), counts[_key(node)], tier_worth(node)
                out[key] = blocks * block_size
                if worth:
                    saved, run = self._tier_blocks(key, hashes[blocks:], worth)
                    best = _best(node, holders, counts) if node in fetching else None
                    if best is not None:  # what a fetch from it would bring beyond the node's own run
                        saved += max(0, counts[_key(best)] - blocks - run) * worth[MEDIUM_PEER]
                    out[key] += round(saved * block_size)
        return out

    def peer_hint(self, target: RegistrationMessage, prompt: str) -> PeerHint | None:
        """The hint for ``target``, the node that will compute ``prompt`` (module docstring), or None:
        it does not run --kv-peer-fetch, the prompt has no token ids, its events are not fresh, or
        no other peer fetcher holds more of the prompt in its pool, host and file tiers (what a peer serves)
        than it holds in pool and tiers."""
        if not target.kv_peer_fetch:  # the one check a request pays while no node runs it
            return None
        key = _key(target)
        if (getattr(prompt, "token_ids", None) is None or target.kv_events is None or not target.block_size
                or not self.index.is_fresh(key)):
            return None
        holders = self._holders(target.kv_events.root, target.block_size)
        if not holders:
            return None
        hashes = _chain(prompt, target.kv_events.root, target.block_size)
        counts = self.index.leading(list(dict.fromkeys([key, *map(_key, holders)])), hashes)
        # a peer serves its host tier's run after its pool's, then its file tier's (each index made
        # once some node stored a block in that tier)
        tiers = [t for t in map(self.index.tiers().get, (MEDIUM_HOST, MEDIUM_DISK)) if t is not None]
        for holder, tier in ((h, t) for t in tiers for h in holders):
            k = _key(holder)
            if k != key and counts[k] < len(hashes):
                flags = tier.held(k, hashes[counts[k]:])
                counts[k] += next((i for i, held in enumerate(flags) if not held), len(flags))
        best = _best(target, holders, counts)
        if best is None:
            return None
        blocks, own = counts[_key(best)], counts[key]
        own += self._tier_blocks(key, hashes[own:blocks], {})[1]
        return PeerHint(best.zmq_address, blocks) if blocks > own else None

    def _holders(self, root: str, block_size: int) -> list[RegistrationMessage]:
        """The peer fetchers naming blocks on this chain with one rank (a peer fetch moves a whole
        block from one endpoint; the registry's ``peers`` name no other)."""
        return [h for h in self.peer_fetchers() if (h.tp_size or 1) == 1 and h.kv_events is not None
                and h.kv_events.root == root and h.block_size == block_size]

    def _tier_blocks(self, key: NodeKey, hashes: list[bytes], worth: dict[str, float]) -> tuple[float, int]:
        """The run of blocks after the pool's that ``key``'s tiers hold, in order: each weighted by the
        worth of the best tier holding it (0 for a tier not measured yet), and how many there are."""
        held = [(worth.get(medium, 0.0), index.held(key, hashes)) for medium, index in self.index.tiers().items()]
        total, run = 0.0, 0
        for i in range(len(hashes)):
            hit = [w for w, flags in held if flags[i]]
            if not hit:
                break
            total, run = total + max(hit), run + 1
        return total, run


@dataclass(frozen=True)
class PeerHint:
    """What the computing leg's body carries as ``pdserve_peer_prefix``: a peer's KV address and how
    many leading blocks of the prompt's chain its pool and then its host tier hold (what it serves)."""

    kv_addr: str
    blocks: int

    def field(self) -> dict:
        return {"kv_addr": self.kv_addr, "blocks": self.blocks}


def _key(node: RegistrationMessage) -> NodeKey:
    return (node.type, node.http_address)


def _best(target: RegistrationMessage, holders: list[RegistrationMessage],
          counts: dict[NodeKey, int]) -> RegistrationMessage | None:
    """Of ``holders``, the one ``target`` may fetch from (another node, of its model and layout: one
    the registry names in its ``peers``) whose pool holds the most leading blocks by ``counts``
    (ties: the least loaded); None when none holds any."""
    mine = (target.model, target.kv_fingerprint)
    fit = [h for h in holders if h.zmq_address != target.zmq_address and (h.model, h.kv_fingerprint) == mine]
    best = min(fit, key=lambda h: (-counts[_key(h)], h.load, h.http_address), default=None)
    return best if best is not None and counts[_key(best)] else None


def _chain(prompt: PromptText, root: str, block_size: int) -> list[bytes]:
    """The prompt's block hashes under ``root`` (hex) and ``block_size``, made once per prompt: the
    prefill and decode picks, the disaggregation policy and the peer hint all read them."""
    hashes = prompt.chains.get((root, block_size))
    if hashes is None:
        tokens = prompt.token_ids
        assert tokens is not None
        hashes = prompt.chains[(root, block_size)] = []
        extend_hashes(hashes, salted_root(bytes.fromhex(root), prompt.cache_salt), lambda s, e: tokens[s:e],
                      block_size, len(tokens) // block_size)
    return hashes


def tier_worth(node: RegistrationMessage) -> dict[str, float]:
    """Per tier medium (and PEER), the share of a token's prefill a hit in it saves ``node`` (0..1),
    from its heartbeat."""
    rates, per_s, per_token = node.kv_tier_load_bytes_per_s, node.prefill_tokens_per_s, node.kv_bytes_per_token
    if not rates or not per_s or not per_token:
        return {}
    compute = 1.0 / per_s
    return {medium: max(0.0, 1.0 - per_token / rate / compute) for medium, rate in rates.items()}
