from __future__ import annotations

import msgpack
import pytest

from common.kv_transfer.messages import PROTOCOL_VERSION, Done, Handshake, MessageError, Pull, decode, encode


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

