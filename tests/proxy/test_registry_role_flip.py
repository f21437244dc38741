"""The registry and a role flip (common/node/role_flip.py): a node draining or fenced is left out of
routing but stays listed; the same node under the other role with a higher role epoch replaces its old
entry at once, and a beat from before the flip is refused."""

from __future__ import annotations

from common.registry_client import RegistrationError, RegistrationMessage
from proxy.registry import ServiceRegistry

ADDR, KV = "127.0.0.1:8100", "127.0.0.1:14579"


def beat(type_: str, epoch: int | None = None, state: str | None = None) -> RegistrationMessage:
    return RegistrationMessage.from_dict({"type": type_, "http_address": ADDR, "zmq_address": KV, "model": "tiny",
                                          "kv_fingerprint": "fp", "role_epoch": epoch, "role_state": state})


def routed(reg: ServiceRegistry) -> dict[str, int]:
    return reg.counts()


def test_a_draining_or_fenced_node_is_listed_but_not_routed() -> None:
    reg = ServiceRegistry(port=0)
    assert reg.register(beat("P")) is None
    assert routed(reg) == {"P": 1, "D": 0}
    for state in ("draining", "fenced"):
        assert reg.register(beat("P", 0, state)) is None
        assert routed(reg) == {"P": 0, "D": 0}
        [node] = reg.nodes("P")
        assert node.info.role_state == state and not node.info.routable
    assert reg.register(beat("P", 0, "serving")) is None
    assert routed(reg) == {"P": 1, "D": 0}


def test_the_other_role_at_a_higher_epoch_replaces_the_node_and_older_beats_are_refused() -> None:
    reg = ServiceRegistry(port=0)
    reg.register(beat("P"))
    assert reg.register(beat("D", 1)) is None
    assert [n.info.type for n in reg.nodes()] == ["D"] and routed(reg) == {"P": 0, "D": 1}
    assert reg.register(beat("P", 0)) == "stale_role_epoch"  # a beat sent before the flip, arriving after it
    assert reg.register(beat("P", 1, "draining")) == "stale_role_epoch"  # not past the epoch the registry has
    assert reg.register(beat("P", 2)) is None  # flipped back
    assert [n.info.type for n in reg.nodes()] == ["P"]


def test_role_fields_are_bounded() -> None:
    for bad in ({"role_epoch": -1}, {"role_epoch": "1"}, {"role_state": "half"}):
        try:
            RegistrationMessage.from_dict({"type": "P", "http_address": ADDR, "zmq_address": KV, **bad})
        except RegistrationError:
            continue
        raise AssertionError(f"{bad} accepted")
