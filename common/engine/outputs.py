"""What the engine hands back to the serving layer, one object per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]
KV_TRANSFER_FAILED = "kv_transfer_failed"  # RequestOutput.error_code: the prompt's KV never came
# RequestOutput.error_code: the node stopped serving the request (a role flip's drain ran out of
# time, common/node/role_flip.py); any other node may serve it, so it is a 503
NODE_DRAINING = "node_draining"


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]  # tokens produced since the previous output
    new_text: str = ""  # detokenized text delta (stop strings already cut)
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    num_cached_tokens: int = 0  # prompt tokens the computing node found in its prefix cache
    new_logprobs: list[dict[int, float]] | None = None  # per new token: {token_id: logprob}
    error: str | None = None  # set with finish_reason "error" (e.g. KV transfer failed)
    # set with ``error`` when the request itself is at fault (the field to name in a 400, e.g. its
    # response_format), None when the node is: only a node's fault is worth another node's try
    error_param: str | None = None
    # a word for a node's error that says where it came from: "kv_transfer_failed" (the prompt's KV
    # never arrived: the prefill end failed, so a retry elsewhere need not avoid this node)
    error_code: str | None = None
    kv_transfer_params: dict = field(default_factory=dict)  # e.g. first token for the decode side
    index: int = 0  # the choice (``SamplingParams.n`` > 1: one request, n choices)
