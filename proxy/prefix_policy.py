"""Prefix-aware routing (``--policy prefix_aware``): send a prompt where its prefix is likely cached.

Without the nodes' KV events the proxy estimates from text. A prompt's text is cut into
``chunk_chars``-character chunks named by a hash chain (like the engine's blocks, so equal names mean equal prefixes).
Each node remembers the chunk names of the prompts recently routed to it (bounded, least
recently used forgotten first): an approximation of what its prefix cache holds, as
SGLang's cache-aware router keeps. A request goes to the node sharing the longest run of
leading chunks, ties to the least loaded; when the loads spread too far apart, or no node
shares anything, it goes to the least loaded node (load as ``least_loaded`` counts it).
When the nodes publish KV events and the proxy knows the prompt's token ids, the exact count of
each node's cached leading blocks replaces the estimate (``proxy/exact_prefix.py``); a node whose
events cannot say counts as caching nothing.
A request's ``cache_salt`` roots its chain, as it roots the engine's: prompts of different
salts share no chunk, so routing follows only what the nodes could actually reuse.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING

from proxy.registry import Node

if TYPE_CHECKING:
    from proxy.exact_prefix import ExactPrefix


class PromptText(str):
    """A prompt's text carrying the request's ``cache_salt``, which keys its chunk names, and its
    token ids when the proxy knows them (``proxy/exact_prefix.py``) -- a ``str``, so routing and
    the disaggregation policy pass it on unchanged."""

    def __new__(cls, text: str, cache_salt: str | None, token_ids: list[int] | None = None) -> PromptText:
        obj = super().__new__(cls, text)
        obj.cache_salt = cache_salt
        obj.token_ids = token_ids
        obj.chains = {}  # (root, block size) -> the token ids' block hashes (proxy/exact_prefix.py)
        return obj


def prompt_text(body: dict) -> str:
    """The part of an OpenAI request body that becomes the prompt, as one string (a
    ``PromptText`` when the body has a ``cache_salt``)."""
    salt = body.get("cache_salt")
    return PromptText(_prompt_text(body), salt) if isinstance(salt, str) else _prompt_text(body)


def _prompt_text(body: dict) -> str:
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # content parts: only text ones matter here
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role')}\x1f{content}\x1e")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):  # token ids (or a list of prompts: the first is what matters)
        first = prompt[0] if prompt and isinstance(prompt[0], (list, str)) else prompt
        return first if isinstance(first, str) else ",".join(map(str, first)) + ","
    return ""


def chunk_hashes(text: str, chunk_chars: int) -> list[bytes]:
    """Names of the full ``chunk_chars`` chunks of ``text``, each covering all text before it
    (and the salt of a salted ``PromptText``)."""
    salt = getattr(text, "cache_salt", None)
    out = []
    parent = b"" if salt is None else hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    data = text.encode("utf-8", "surrogatepass")
    step = chunk_chars  # bytes, not characters: the same cut for the same text is all that matters
    for start in range(0, len(data) - step + 1, step):
        parent = hashlib.blake2b(parent + data[start:start + step], digest_size=8).digest()
        out.append(parent)
    return out


class PrefixAware:
    """The node holding the longest prompt prefix, balanced against load."""

    def __init__(self, chunk_chars: int = 64, max_chunks_per_node: int = 200_000,
                 balance_abs: int = 4, balance_rel: float = 1.5) -> None:
        self.chunk_chars = chunk_chars
        self.max_chunks_per_node = max_chunks_per_node
        # load-spread threshold: both must hold (SGLang's rule), so small counts never trip it
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self._seen: dict[tuple[str, str], OrderedDict[bytes, None]] = {}
        self.exact: ExactPrefix | None = None  # set when the nodes' KV events are indexed

    def choose(self, nodes: list[Node], inflight: Counter, prompt: str = "") -> Node:
        return self.choose_with_reason(nodes, inflight, prompt)[0]

    def choose_with_reason(self, nodes: list[Node], inflight: Counter, prompt: str = "") -> tuple[Node, str]:
        """The node and why: ``prefix_events`` (the longest cached prefix by the nodes' KV events),
        ``prefix_text`` (by the text estimate), ``load`` (nothing matched, or the loads too far apart)."""
        def load(n: Node) -> int:
            return n.info.load + inflight[n.key]

        def least_key(n: Node) -> tuple:
            free = n.info.num_free_blocks if n.info.num_free_blocks is not None else 0
            return (load(n), -free, n.info.http_address)

        chunks = chunk_hashes(prompt, self.chunk_chars)
        loads = [load(n) for n in nodes]
        lo, hi = min(loads), max(loads)
        reason = "load"
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            best = min(nodes, key=least_key)
        else:
            exact = self.exact.cached_tokens([n.info for n in nodes], prompt) if self.exact is not None else None
            if exact is not None:  # a node whose events cannot say counts 0 (cache-unknown)
                matched, kind = exact, "prefix_events"
            else:
                matched, kind = {n.key: self.matched(n.key, chunks) for n in nodes}, "prefix_text"
            best = min(nodes, key=lambda n: (-matched[n.key], *least_key(n)))
            if matched[best.key] > 0:
                reason = kind
        self.remember(best.key, chunks)
        return best, reason

    def forget_all_but(self, live: set[tuple[str, str]]) -> None:
        """Drop what was remembered for nodes that are no longer registered."""
        for key in [k for k in self._seen if k not in live]:
            del self._seen[key]

    def matched(self, key: tuple[str, str], chunks: list[bytes]) -> int:
        """How many leading ``chunks`` were routed to the node ``key`` recently."""
        seen = self._seen.get(key)
        if not seen:
            return 0
        n = 0
        for h in chunks:
            if h not in seen:
                break
            n += 1
        return n

    def remember(self, key: tuple[str, str], chunks: list[bytes]) -> None:
        """Note that the prompt of ``chunks`` went to the node ``key``."""
        seen = self._seen.setdefault(key, OrderedDict())
        for h in chunks:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_chunks_per_node:
            seen.popitem(last=False)
