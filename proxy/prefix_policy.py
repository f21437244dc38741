"""Prefix-aware routing (``--policy prefix_aware``): send a prompt where its prefix is likely cached.

The proxy tokenizes nothing. A prompt's text is cut into ``chunk_chars``-character chunks
named by a hash chain (like the engine's blocks, so equal names mean equal prefixes).
Each node remembers the chunk names of the prompts recently routed to it (bounded, least
recently used forgotten first): an approximation of what its prefix cache holds, as
SGLang's cache-aware router keeps. A request goes to the node sharing the longest run of
leading chunks, ties to the least loaded; when the loads spread too far apart, or no node
shares anything, it goes to the least loaded node (load as ``least_loaded`` counts it).
A request's ``cache_salt`` roots its chain, as it roots the engine's: prompts of different
salts share no chunk, so routing follows only what the nodes could actually reuse.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict

from proxy.registry import Node


class PromptText(str):
    """A prompt's text carrying the request's ``cache_salt``, which keys its chunk names (a
    ``str``, so routing and the disaggregation policy pass it on unchanged)."""

    def __new__(cls, text: str, cache_salt: str) -> PromptText:
        obj = super().__new__(cls, text)
        obj.cache_salt = cache_salt
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

    def choose(self, nodes: list[Node], inflight: Counter, prompt: str = "") -> Node:
        def load(n: Node) -> int:
            return n.info.load + inflight[n.key]

        def least_key(n: Node) -> tuple:
            free = n.info.num_free_blocks if n.info.num_free_blocks is not None else 0
            return (load(n), -free, n.info.http_address)

        chunks = chunk_hashes(prompt, self.chunk_chars)
        loads = [load(n) for n in nodes]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            best = min(nodes, key=least_key)
        else:
            matched = {n.key: self.matched(n.key, chunks) for n in nodes}
            best = min(nodes, key=lambda n: (-matched[n.key], *least_key(n)))
        self.remember(best.key, chunks)
        return best

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
