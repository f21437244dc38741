"""The cluster key file (made private, checked at start) and the warning a keyless process
binding a non-loopback address gives at start (issue 11, "what it must do" 1)."""

from __future__ import annotations

import hashlib

import logging
import time

import pytest

from common.cluster_auth import SEAL_WINDOW_S, ClusterKey, SealChecker, warn_if_open
from proxy.app import build_app
from proxy.config import ProxyConfig


def test_proxy_registry_on_all_interfaces_without_a_key_warns(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING):
        build_app(ProxyConfig(port=0, registry_port=0, registry_host="0.0.0.0"))
    messages = [r.message for r in caplog.records]
    assert any("without a cluster key" in m and "register a node" in m for m in messages)


@pytest.mark.parametrize("host, keyed, warns", [
    ("0.0.0.0", False, True), ("10.1.2.3", False, True), ("127.0.0.1", False, False),
    ("0.0.0.0", True, False),
])
def test_warning_only_for_keyless_non_loopback(caplog: pytest.LogCaptureFixture, host, keyed, warns):
    key = ClusterKey(b"0123456789abcdef-cluster") if keyed else None
    with caplog.at_level(logging.WARNING):
        warn_if_open("decode daemon", host, key, "send requests past the API key")
    assert any("without a cluster key" in r.message for r in caplog.records) == warns


def test_generated_key_is_private_and_signs_ids(tmp_path):
    path = ClusterKey.generate(tmp_path / "cluster.key")
    assert path.stat().st_mode & 0o777 == 0o600
    key = ClusterKey.load(path)
    rid = "___prefill_addr_h:1___decode_addr_h:2_abc"
    signature = key.sign_id(rid, "prefill", b"{}")
    assert key.check_id(rid, signature, "prefill") is None
    assert key.signed_body_digest(signature) == hashlib.sha256(b"{}").hexdigest()
    assert "does not match" in key.check_id(rid + "x", signature, "prefill")
    assert "does not match" in key.check_id(rid, signature, "decode")  # signed for the other role
    forged = signature.replace(key.signed_body_digest(signature), hashlib.sha256(b"[]").hexdigest())
    assert "does not match" in key.check_id(rid, forged, "prefill")  # the digest is under the MAC
    assert "expired" in key.check_id(rid, key.sign_id(rid, "prefill", b"{}", ttl_s=-1), "prefill")
    other = ClusterKey.load(ClusterKey.generate(tmp_path / "other.key"))
    assert "does not match" in key.check_id(rid, other.sign_id(rid, "prefill", b"{}"), "prefill")



def test_a_seal_is_good_once_within_its_window_for_its_purpose_only(monkeypatch):
    """Registry and KV control frames: a seal from another key or purpose, one older than the
    30 s window, or one seen before is refused, each with its reason."""
    key = ClusterKey(b"0123456789abcdef-cluster")
    control = SealChecker(key, b"pdserve-kv-control")
    seal = key.seal(b"pdserve-kv-control", b"ping")
    assert control.check(b"ping", seal) is None
    assert control.check(b"ping", seal) == "replayed"
    assert control.check(b"pong", key.seal(b"pdserve-kv-control", b"ping")) == "bad_signature"
    assert control.check(b"ping", key.seal(b"pdserve-registry", b"ping")) == "bad_signature"
    assert control.check(b"ping", ClusterKey(b"another-cluster-0123456789").seal(b"pdserve-kv-control", b"ping")) \
        == "bad_signature"
    assert control.check(b"ping", None) == "unauthenticated"
    old = key.seal(b"pdserve-kv-control", b"ping")
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + SEAL_WINDOW_S + 1)
    assert control.check(b"ping", old) == "stale"

def test_a_short_or_missing_key_file_is_a_one_line_config_error(tmp_path):
    (tmp_path / "short.key").write_text("abc")
    cases = ((tmp_path / "short.key", "at least 16 bytes"), (tmp_path / "none.key", "cannot read"))
    for path, problem in cases:
        with pytest.raises(ValueError, match=problem):
            ProxyConfig(cluster_key_file=str(path))
