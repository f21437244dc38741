from __future__ import annotations

import msgpack
import pytest

from common.kv_transfer.messages import (PROTOCOL_VERSION, Done, Handshake, LayerNotice, MessageError, Pull, decode,
                                         encode)
from common.kv_transfer.peer_checks import check_notice
from kvt_fixtures import LAYOUT  # 4 layers, 2 KV heads, head_dim 16, block_size 4, bfloat16


def test_round_trip_keeps_type_and_fields():
    for msg in (Pull(id=7, request_id="r", pair_id="p", num_blocks=3, num_tokens=10, block_ids=[4, 2, 9]),
                Handshake(pair_id="p", layout={"num_layers": 2}, backend="gloo"),
                Done(request_id="r", pair_id="p", first_token=5)):
        assert decode(encode(msg)) == msg


@pytest.mark.parametrize("frame", [
    b"\xc1garbage",
    msgpack.packb([1, 2, 3]),
    msgpack.packb({"v": PROTOCOL_VERSION + 1, "cmd": "pull"}),
    msgpack.packb({"v": PROTOCOL_VERSION, "cmd": "launch_missiles", "id": 0}),
    msgpack.packb({"v": PROTOCOL_VERSION, "cmd": "pull", "id": 0}),  # fields missing
])
def test_bad_frames_raise_message_error(frame):
    with pytest.raises(MessageError):
        decode(frame)


def _pull_with(**changes) -> bytes:
    fields = {"v": PROTOCOL_VERSION, "cmd": "pull", "id": 1, "request_id": "r", "pair_id": "p", "num_blocks": 2,
              "num_tokens": 20, "block_ids": [0, 1], "first_block": 0}
    return msgpack.packb({**fields, **changes})


@pytest.mark.parametrize("change", [{"num_blocks": "2"}, {"num_blocks": True}, {"num_tokens": 2.5},
                                    {"request_id": 7}, {"block_ids": {"0": 1}}, {"id": None}])
def test_a_field_of_the_wrong_type_is_refused(change):
    """A sealed frame from a peer with the key is still checked: each field has its type."""
    assert decode(_pull_with()).num_blocks == 2
    with pytest.raises(MessageError, match=next(iter(change))):
        decode(_pull_with(**change))



@pytest.mark.parametrize("change", [{"dtype": "float16"}, {"dtype": "float128"}, {"layers": [0, 0]}, {"layers": [4]},
                                    {"layers": []}, {"parts": 3}, {"parts": 2, "layers": [0, 1]},
                                    {"shape": [2, 3, 4, 2]}, {"shape": [2, 3, 4, 4, 16]}, {"shape": [2, 9, 4, 2, 16]},
                                    {"shape": [2, 0, 4, 2, 16]}, {"shape": [2, "3", 4, 2, 16]}])
def test_a_layer_notice_off_our_layout_or_past_the_requests_blocks_is_refused(change):
    """A layer notice sizes a staging buffer: its dtype, layers, parts and shape are checked
    against our layout and the request's block count before anything is allocated."""
    good = {"request_id": "r", "pair_id": "p", "layers": [0, 1], "dtype": "bfloat16", "shape": [2, 3, 4, 2, 16],
            "parts": 1}
    assert check_notice(LayerNotice(**good), LAYOUT, max_blocks=8) is None
    assert check_notice(LayerNotice(**{**good, **change}), LAYOUT, max_blocks=8) is not None
