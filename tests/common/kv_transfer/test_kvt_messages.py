from __future__ import annotations

import msgpack
import pytest

from common.kv_transfer.messages import PROTOCOL_VERSION, Done, Handshake, MessageError, Pull, decode, encode


def test_round_trip_keeps_type_and_fields():
    for msg in (Pull(id=7, request_id="r", pair_id="p", num_blocks=3, num_tokens=10),
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
