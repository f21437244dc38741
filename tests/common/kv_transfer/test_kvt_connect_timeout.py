"""``--kv-connect-timeout-s``: building a data-plane pair has its own bound, longer than
``--kv-timeout-s`` (NCCL's first communicator set-up takes seconds)."""

from __future__ import annotations

import pytest

import common.kv_transfer.producer as producer_mod
import common.kv_transfer.pair_handshake as receiver_mod  # the consumer builds its pair there
import common.kv_transfer.sender as sender_mod
from common.config import NodeConfig, load_config
from common.node.daemon import transfer_config
from common.kv_transfer.config import TransferConfig
from common.kv_transfer.endpoint import KVEndpoint
from kvt_fixtures import FAST, LAYOUT, no_thread_leak  # noqa: F401
from kvt_peers import make_kv
from test_kvt_engine import P_BLOCKS, assert_landed, d_cache, wait_finished


def _node(argv: list[str], env: dict | None = None) -> NodeConfig:
    return load_config(NodeConfig, argv, "pdserve prefill", fixed={"role": "prefill"}, env=env or {})


def test_option_reaches_the_transfer_config_from_flag_env_and_file(tmp_path):
    default = transfer_config(_node([]))
    assert default.connect_timeout_s == 60.0 and default.timeout_s == default.handshake_timeout_s == 5.0
    assert transfer_config(_node(["--kv-connect-timeout-s", "42"])).connect_timeout_s == 42.0
    assert transfer_config(_node([], {"PDSERVE_KV_CONNECT_TIMEOUT_S": "33"})).connect_timeout_s == 33.0
    toml = tmp_path / "node.toml"
    toml.write_text("kv_connect_timeout_s = 21.5\nkv_timeout_s = 3.0\n")
    cfg = transfer_config(_node(["--config", str(toml)]))
    assert (cfg.connect_timeout_s, cfg.timeout_s, cfg.handshake_timeout_s) == (21.5, 3.0, 3.0)


def test_a_bad_value_is_one_line_naming_the_option(capsys):
    with pytest.raises(SystemExit) as exit_:
        _node(["--kv-connect-timeout-s", "0"])
    assert exit_.value.code == 2
    assert "--kv-connect-timeout-s" in capsys.readouterr().err


@pytest.mark.parametrize("transport", ["gloo", "tcp"])
def test_pair_set_up_waits_for_the_connect_bound_and_operations_for_kv_timeout(transport, monkeypatch,
                                                                              no_thread_leak):
    """Both sides build the pair with connect_timeout_s (the producer's rendezvous too) and
    hand the pair timeout_s for its operations; the pair that results carries both."""
    seen: list[tuple[str, float, float]] = []
    pairs: list = []

    def spy(module, name):
        real = getattr(module, name)

        def call(*args, **kwargs):
            if name == "listen":
                seen.append(("listen", args[2], 0.0))
                return real(*args, **kwargs)
            pair = real(*args, **kwargs)
            seen.append((f"rank{args[1]}", kwargs["connect_timeout_s"], args[2]))
            pairs.append(pair)
            return pair

        monkeypatch.setattr(module, name, call)

    spy(producer_mod, "listen")
    spy(sender_mod, "open_pair")
    spy(receiver_mod, "open_pair")
    cfg = TransferConfig(**dict(FAST, timeout_s=2.0, handshake_timeout_s=2.0, connect_timeout_s=7.0))
    with KVEndpoint("127.0.0.1:0", LAYOUT, cfg, transport=transport) as p, \
            KVEndpoint("127.0.0.1:0", LAYOUT, cfg, transport=transport) as d:
        kv = d_cache()
        d.consumer.request("c", p.address, [4, 9], 8, kv)
        p.producer.finish("c", 5, make_kv(LAYOUT, P_BLOCKS, 6), [1, 7], 8)
        assert wait_finished(d, {"c"}) == ({"c": 5}, {})
        assert_landed(kv, [4, 9], 6, [1, 7], 8)
    assert sorted(seen) == [("listen", 7.0, 0.0), ("rank0", 7.0, 2.0), ("rank1", 7.0, 2.0)]
    for pair in pairs:
        assert pair.timeout_s == 2.0
        if transport == "gloo":
            assert pair.connect_timeout_s == 7.0
