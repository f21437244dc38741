"""What a producer says is checked like client input before anything uses it.

A DONE's first token goes straight into a decode batch and its logprobs into a client's
reply; a layer notice's shape sizes a staging buffer. A value out of range would end the
engine thread (an embedding lookup outside the vocabulary) or allocate without bound, so
each check returns why a message cannot be used and the caller fails that request alone.
"""

from __future__ import annotations

import math

from common.kv_layout import KVLayout
from common.kv_transfer.messages import Done, LayerNotice
from common.kv_transfer.p2p_group import DTYPE_NAMES

MAX_FIRST_LOGPROBS = 21  # the chosen token and up to 20 alternatives (SamplingParams.logprobs <= 20)
_NO_VOCAB = 2**31  # the bound when the vocabulary size is not known


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_done(msg: Done, vocab_size: int | None) -> str | None:
    """Why ``msg``'s first token or logprobs cannot be used, or None."""
    limit = vocab_size or _NO_VOCAB
    if not 0 <= msg.first_token < limit:
        return f"first token {msg.first_token} is outside the vocabulary [0, {limit})"
    if len(msg.first_logprobs) > MAX_FIRST_LOGPROBS:
        return f"{len(msg.first_logprobs)} first-token logprobs (at most {MAX_FIRST_LOGPROBS})"
    for entry in msg.first_logprobs:
        if not isinstance(entry, list | tuple) or len(entry) != 2:
            return f"first-token logprob {entry!r:.80} is not [token_id, logprob]"
        token, logprob = entry
        if not _is_int(token) or not 0 <= token < limit:
            return f"first-token logprob names token {token!r:.40}, outside the vocabulary [0, {limit})"
        if not isinstance(logprob, int | float) or isinstance(logprob, bool) or not math.isfinite(logprob) \
                or logprob > 0:
            return f"first-token logprob {logprob!r:.40} is not a finite float <= 0"
    return None


def check_notice(msg: LayerNotice, layout: KVLayout, max_blocks: int) -> str | None:
    """Why a layer notice does not describe KV of our layout in at most ``max_blocks`` blocks."""
    if msg.dtype not in DTYPE_NAMES or DTYPE_NAMES[msg.dtype] != layout.torch_dtype:
        return f"dtype {msg.dtype!r:.40} is not the layout's {layout.dtype}"
    if msg.parts not in (1, 2) or (msg.parts == 2 and len(msg.layers) != 1):
        return f"{msg.parts} parts for {len(msg.layers)} layers"
    layers = msg.layers
    if not layers or len(set(layers)) != len(layers) or \
            not all(_is_int(x) and 0 <= x < layout.num_layers for x in layers):
        return f"layers {layers!r:.80} are not distinct layers of {layout.num_layers}"
    shape = msg.shape
    if len(shape) != 5 or not all(_is_int(d) for d in shape) or not 0 < shape[1] <= max_blocks:
        return f"shape {shape!r:.80} is not [2, blocks <= {max_blocks}, ...]"
    if list(shape) != list(layout.layer_shape(shape[1])):
        return f"shape {shape} is not the layout's {list(layout.layer_shape(shape[1]))}"
    return None
