"""The tagged request id the proxy builds (wire-compatible with vLLM's xPyD proxy).

    ___prefill_addr_{host}:{port}___decode_addr_{host}:{port}_{uuid_hex}

Daemons use the id exactly as received; they never rewrite or suffix it.

A local prefill (the proxy decided the decode node should compute the prompt itself, and sent
no prefill leg) names :data:`LOCAL_PREFILL` as the prefill address: ``local:0`` is no KV
endpoint (port 0), so a daemon that does not know the marker fails it plainly, and under a
cluster key the marker is covered by the id's signature like any address.

A prefill node asked through ``kv_transfer_params`` (common/serving/kv_params.py) does not know
which decode node will pull; the transfer id it makes names :data:`ANY_DECODE` as decode address
(port 0: no endpoint). The producer never reads a decode address (a pull names the id itself).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

_PREFILL_RE = re.compile(r"___prefill_addr_(.*):(\d+)___")
_DECODE_RE = re.compile(r"___decode_addr_(.*):(\d+)")
LOCAL_PREFILL = "local:0"  # the prefill address of a request the decode node prefills itself
ANY_DECODE = "any:0"  # the decode address of a kv_transfer_params transfer id: whoever pulls it


@dataclass(frozen=True)
class Tags:
    prefill_addr: str  # "host:port" of the prefill node's KV (ZMQ) endpoint
    decode_addr: str

    @property
    def local_prefill(self) -> bool:
        """True when the decode node computes the prompt itself: no prefill leg, no KV to ask for."""
        return self.prefill_addr == LOCAL_PREFILL


def make_request_id(prefill_kv_addr: str, decode_kv_addr: str, suffix: str | None = None) -> str:
    return f"___prefill_addr_{prefill_kv_addr}___decode_addr_{decode_kv_addr}_{suffix or uuid.uuid4().hex}"


def parse_tags(request_id: str | None) -> Tags | None:
    """Both addresses, or None when the id is not tagged."""
    if not request_id:
        return None
    p = _PREFILL_RE.search(request_id)
    d = _DECODE_RE.search(request_id)
    if not p or not d:
        return None
    decode_host = d.group(1)
    return Tags(prefill_addr=f"{p.group(1)}:{p.group(2)}", decode_addr=f"{decode_host}:{d.group(2)}")
