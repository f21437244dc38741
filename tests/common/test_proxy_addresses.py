"""``--proxy``'s text (common/proxy_addresses.py): a list of HOST:PORT, each an IP literal or a DNS
name; a name resolves to its IPv4 addresses (its IPv6 ones if it has none), bounded."""

from __future__ import annotations

import socket

import pytest

from common.config import NodeConfig, load_config
from common.proxy_addresses import (
    MAX_PROXY_ADDRESSES,
    MAX_PROXY_ENTRIES,
    ProxyEntry,
    parse_proxy_list,
    resolve,
)


def test_a_list_of_literals_and_names_in_order_each_once() -> None:
    entries = parse_proxy_list(" 10.0.0.1:30001, proxy-0.pdserve.svc:30001,[fd00::1]:30002,10.0.0.1:30001")
    assert entries == (ProxyEntry("10.0.0.1", 30001), ProxyEntry("proxy-0.pdserve.svc", 30001),
                       ProxyEntry("fd00::1", 30002))
    assert [e.is_name for e in entries] == [False, True, False]
    assert [str(e) for e in entries] == ["10.0.0.1:30001", "proxy-0.pdserve.svc:30001", "[fd00::1]:30002"]


@pytest.mark.parametrize("text, says", [
    ("", "empty entry"),
    ("nohost", "has no port"),
    ("a:0", "has no port"),
    ("a:65536", "has no port"),
    ("a:1,,b:1", "empty entry"),
    ("a:1,", "empty entry"),
    ("fd00::1:30001", "in brackets, [fd00::1]:30001"),
    ("[10.0.0.1]:1", "not an IPv6 address"),
    ("bad host:1", "neither an IP address nor a DNS name"),
    ("a..b:1", "neither an IP address nor a DNS name"),
    ("-a:1", "neither an IP address nor a DNS name"),
    (("x" * 64) + ".example:1", "neither an IP address nor a DNS name"),  # a label is at most 63
    (",".join(f"10.0.0.{i}:1" for i in range(MAX_PROXY_ENTRIES + 1)), f"at most {MAX_PROXY_ENTRIES} proxies"),
    ("a:1," * 10_000, f"at most {MAX_PROXY_ENTRIES} proxies"),
])
def test_a_bad_list_is_refused_naming_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match="must") as err:
        parse_proxy_list(text)
    assert says in str(err.value)


def test_the_flag_takes_a_list_and_a_resolve_interval() -> None:
    cfg = load_config(NodeConfig, ["--role", "decode", "--proxy", "10.0.0.1:30001, p.svc:30001",
                                   "--proxy-resolve-interval-s", "7"], "pdserve decode", env={})
    assert cfg.proxy == "10.0.0.1:30001,p.svc:30001" and cfg.proxy_resolve_interval_s == 7.0
    assert cfg.proxy_entries == (ProxyEntry("10.0.0.1", 30001), ProxyEntry("p.svc", 30001))
    defaults = load_config(NodeConfig, ["--role", "decode"], "pdserve decode", env={})
    assert defaults.proxy_entries == () and defaults.proxy_resolve_interval_s == 2.0


def _dns(answers: dict[int, list[str]]):
    """A getaddrinfo answering from ``answers`` (family -> hosts); a family with none: no such name."""
    def getaddrinfo(host: str, port: int, family: int, kind: int) -> list:
        hosts = answers.get(family)
        if not hosts:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(family, kind, 6, "", (h, port) if family == socket.AF_INET else (h, port, 0, 0)) for h in hosts]
    return getaddrinfo


def test_a_literal_is_itself_and_is_not_looked_up() -> None:
    def no_dns(*args: object) -> list:
        raise AssertionError("a literal was looked up")
    assert resolve(ProxyEntry("10.0.0.1", 1), no_dns) == ("10.0.0.1:1",)
    assert resolve(ProxyEntry("fd00::1", 1), no_dns) == ("[fd00::1]:1",)


def test_a_name_is_every_ipv4_address_it_has_sorted_each_once() -> None:
    dns = _dns({socket.AF_INET: ["10.0.0.2", "10.0.0.1", "10.0.0.2"], socket.AF_INET6: ["fd00::1"]})
    assert resolve(ProxyEntry("proxies.svc", 30001), dns) == ("10.0.0.1:30001", "10.0.0.2:30001")


def test_a_name_with_only_ipv6_addresses_is_those() -> None:
    dns = _dns({socket.AF_INET6: ["fd00::2", "fd00::1"]})
    assert resolve(ProxyEntry("proxies.svc", 30001), dns) == ("[fd00::1]:30001", "[fd00::2]:30001")


def test_a_name_that_does_not_resolve_raises() -> None:
    with pytest.raises(socket.gaierror):
        resolve(ProxyEntry("nowhere.invalid", 1), _dns({}))


def test_a_huge_dns_answer_is_cut_to_the_bound() -> None:
    dns = _dns({socket.AF_INET: [f"10.0.{i // 256}.{i % 256}" for i in range(1000)]})
    assert len(resolve(ProxyEntry("proxies.svc", 1), dns)) == MAX_PROXY_ADDRESSES


def test_the_host_name_localhost_is_one_proxy() -> None:
    assert resolve(ProxyEntry("localhost", 30001)) == ("127.0.0.1:30001",)
