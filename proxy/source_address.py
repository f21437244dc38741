"""Keyless registration: is a node registering the host its connection comes from?

Without a cluster key nothing ties a registration (or a goodbye) to its sender but the
connection's own source address, which libzmq gives each message of a tcp connection
(``Peer-Address``). The registry takes a keyless message only when both addresses it names are
that address (:func:`from_own_address`).
"""

from __future__ import annotations

import ipaddress

import zmq

from common.registry_client import RegistrationMessage


def peer_address(frame: zmq.Frame) -> str | None:
    """The address a message's connection comes from (libzmq's ``Peer-Address``, tcp); None
    where the transport cannot tell."""
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, KeyError, ValueError):
        return None


def from_own_address(msg: RegistrationMessage, peer: str | None) -> bool:
    """Do the addresses the message names (HTTP, KV and KV events) lie on the host its connection comes from?

    Keyless this is all that ties a registration, or a goodbye, to its sender: a stranger can no
    longer register a node at someone else's address or say goodbye for a live node on another
    host. Processes on one host share its address, so they still cannot be told apart; an address
    given as a name (other than ``localhost``) is refused: the check compares IP addresses, and
    resolving strangers' names would stall this thread. True when the transport cannot tell."""
    if peer is None:
        return True
    try:
        source = _normal(ipaddress.ip_address(peer))
    except ValueError:
        return False
    events = (msg.kv_events.endpoint, msg.kv_events.replay) if msg.kv_events is not None else ()
    for address in (msg.http_address, msg.zmq_address, *events):  # the proxy connects to the events' too
        host = address.rpartition(":")[0].strip("[]")
        try:
            named = _normal(ipaddress.ip_address("127.0.0.1" if host == "localhost" else host))
        except ValueError:
            return False
        if named != source:
            return False
    return True


def _normal(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IPv4 address written as IPv6 (``::ffff:a.b.c.d``) as plain IPv4."""
    return ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip
