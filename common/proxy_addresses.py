"""``--proxy``: the proxies a daemon registers with, as written and as resolved.

The flag is a comma-separated list of ``HOST:PORT`` entries. A host is an IPv4 literal, an IPv6
literal in brackets (``[fd00::1]:30001``) or a DNS name; a name may resolve to several addresses,
each a proxy of its own (a Kubernetes headless Service names every proxy pod)::

    --proxy 10.0.0.1:30001,10.0.0.2:30001
    --proxy pdserve-proxy-registry.pdserve.svc.cluster.local:30001

:func:`parse_proxy_list` checks the text once, when the flags are read; :func:`resolve` turns one
entry into addresses, again every ``--proxy-resolve-interval-s`` (common/proxy_heartbeats.py).
A name yields its IPv4 addresses, or its IPv6 ones when it has none (``localhost`` is one proxy,
not two). Everything is bounded: the flag may come from a file or an environment someone else
wrote, and a DNS answer from anyone who can answer DNS.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass

MAX_PROXY_ENTRIES = 16  # entries in --proxy
MAX_PROXY_ADDRESSES = 64  # addresses heartbeated at once, over every entry's resolution
_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")

GetAddrInfo = Callable[..., list]


@dataclass(frozen=True, order=True)
class ProxyEntry:
    """One ``HOST:PORT`` of ``--proxy``: ``host`` without brackets."""

    host: str
    port: int

    @property
    def is_name(self) -> bool:
        """A DNS name (resolved, again and again) rather than an IP literal (used as it is)."""
        return _ip(self.host) is None

    def __str__(self) -> str:
        return host_port(self.host, self.port)


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (as ZMQ's ``tcp://`` endpoints want it)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _is_dns_name(host: str) -> bool:
    return len(host) <= 253 and all(_LABEL.match(label) for label in host.rstrip(".").split("."))


def parse_entry(text: str) -> ProxyEntry:
    """One ``HOST:PORT``; raises ValueError saying what is wrong with it."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text!r} has no port in 1..65535")
    if host.startswith("[") and host.endswith("]"):
        if not isinstance(_ip(host[1:-1]), ipaddress.IPv6Address):
            raise ValueError(f"{text!r}: {host} is not an IPv6 address")
        return ProxyEntry(host[1:-1], int(port))
    if ":" in host:
        raise ValueError(f"{text!r}: an IPv6 address goes in brackets, [{host}]:{port}")
    if _ip(host) is None and not _is_dns_name(host):
        raise ValueError(f"{text!r}: {host!r} is neither an IP address nor a DNS name")
    return ProxyEntry(host, int(port))


def parse_proxy_list(text: str) -> tuple[ProxyEntry, ...]:
    """``--proxy``'s entries in order, each once; raises ValueError naming the bad entry."""
    items = [item.strip() for item in text.split(",")]
    if len(items) > MAX_PROXY_ENTRIES or len(text) > MAX_PROXY_ENTRIES * 264:
        raise ValueError(f"must name at most {MAX_PROXY_ENTRIES} proxies (a DNS name may stand for more)")
    try:
        if "" in items:
            raise ValueError(f"{text!r} has an empty entry")
        return tuple(dict.fromkeys(parse_entry(item) for item in items))
    except ValueError as exc:
        raise ValueError(f"must be HOST:PORT, or several separated by commas: {exc}") from None


def resolve(entry: ProxyEntry, getaddrinfo: GetAddrInfo = socket.getaddrinfo) -> tuple[str, ...]:
    """The ``host:port`` addresses ``entry`` stands for, sorted: an IP literal itself; a name its IPv4
    addresses (its IPv6 ones if it has none), at most ``MAX_PROXY_ADDRESSES``. Raises OSError
    (``socket.gaierror``) when the name does not resolve."""
    if not entry.is_name:
        return (str(entry),)
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            infos = getaddrinfo(entry.host, entry.port, family, socket.SOCK_STREAM)
        except socket.gaierror:
            if family == socket.AF_INET6:
                raise
            continue
        hosts = {str(ip) for info in infos if (ip := _ip(info[4][0])) is not None}
        if hosts:
            return tuple(sorted(host_port(h, entry.port) for h in hosts))[:MAX_PROXY_ADDRESSES]
    raise socket.gaierror(socket.EAI_NONAME, f"{entry.host} has no address")
