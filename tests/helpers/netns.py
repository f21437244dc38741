"""A multi-host test bed on one machine: hosts in network namespaces joined by a bridge.

Each host is a namespace with one interface (``eth0``, its own address on a private
/24) plugged into a bridge that lives in a namespace of its own; the test process's
namespace is plugged in too, so tests and benches reach every host by its address.
Processes run in a host with ``ip netns exec`` (the venv's python, this tree's
PYTHONPATH). Faults are per pair of hosts and silent, like a real partition:

- ``cut(a, b)``: ``a`` sends its frames for ``b`` to a MAC nobody owns (a permanent
  neighbour entry): they vanish, no RST, no ICMP; ``heal`` removes the entry;
- ``netem(a, b, spec)``: ``tc netem`` delay / loss on ``a``'s packets to ``b`` (needs the
  kernel's sch_netem; ``netem_unavailable()`` says why not); ``throttle(a, b, rate)``: the
  same with a rate instead (plain htb), ``clear_netem(a)`` removes either;
- ``delay_link(a, b)``: where there is no netem, a second link between two hosts through
  a user-space relay (delay_relay.py) with a settable one-way delay and loss.

Every namespace is named ``pdsmh-<pid>-<tag>-...`` (a random tag per bed): deleting them
removes every link the bed made (the bridge, and the veths whose ends are in them), and
a later bed deletes the ones whose pid is gone (a crashed run), killing what still ran
in them.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.config import ROLE_HTTP_PORTS, ROLE_KV_PORTS
from pdserve.launcher import is_alive
from helpers import zygote
from helpers.cluster import MODULES, ROOT, Proc, node_env
from proxy.config import ProxyConfig

PREFIX = "pdsmh"
NOWHERE_MAC = "02:00:00:00:00:01"  # locally administered, owned by no interface on the bridge


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why this machine cannot host the bed (a skip reason), or None."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to create network namespaces"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    made = ip("netns", "add", probe, check=False)
    ip("netns", "del", probe, check=False)
    return None if made.returncode == 0 else f"`ip netns add` failed: {made.stderr.strip()}"


def cleanup_stale() -> None:
    """Delete namespaces left by runs whose process is gone, and stop what still runs in them."""
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(rf"{PREFIX}-(\d+)-", name)
        if not m or is_alive(int(m.group(1))):
            continue
        for pid in ip("netns", "pids", name, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        ip("netns", "del", name, check=False)


def _free_subnet() -> int:
    """A third octet ``x`` such that 10.77.x.0/24 is routed nowhere yet on this host."""
    used = ip("-4", "route", "show", check=False).stdout
    for x in [os.getpid() % 200 + 20, *range(20, 250)]:
        if f"10.77.{x}." not in used:
            return x
    raise RuntimeError("no free 10.77.x.0/24 subnet")


@dataclass
class Host:
    name: str
    ns: str
    ip: str


@dataclass
class NsProc(Proc):
    """A pdserve process in a host: reached at the host's address, not loopback."""

    host: Host | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host.ip}:{self.port}"

    @property
    def kv_addr(self) -> str:
        return f"{self.host.ip}:{self.kv_port}"

    def counts(self) -> tuple[int, int]:
        """(threads, open file descriptors) of the process, read from /proc."""
        pid = self.popen.pid
        return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class DelayLink:
    """The relay behind ``Bed.delay_link``; ``set`` changes its delay and loss at once."""

    relay: subprocess.Popen

    def set(self, one_way_ms: float, loss: float = 0.0) -> None:
        self.relay.stdin.write(f"{one_way_ms} {loss}\n")
        self.relay.stdin.flush()

    def close(self) -> None:
        if self.relay.poll() is None:
            self.relay.kill()
        self.relay.wait(timeout=10)


@dataclass
class Bed:
    """Namespaces on one bridge; ``close`` removes everything it made."""

    run: str = field(default_factory=lambda: f"{os.getpid()}-{secrets.token_hex(2)}")
    hosts: dict[str, Host] = field(default_factory=dict)
    procs: list[NsProc] = field(default_factory=list)
    links: list[DelayLink] = field(default_factory=list)

    def __post_init__(self) -> None:
        cleanup_stale()
        self.subnet = _free_subnet()
        self.bridge_ns = f"{PREFIX}-{self.run}-br"
        try:
            ip("netns", "add", self.bridge_ns)
            ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            # the test process's own namespace is the .1 host: veth end here, bridge port there
            here = self.root_link
            ip("link", "add", here, "type", "veth", "peer", "name", "port", "netns", self.bridge_ns)
            self._plug("port")
            ip("addr", "add", f"10.77.{self.subnet}.1/24", "dev", here)
            ip("link", "set", here, "up")
        except BaseException:
            self.close()
            raise

    @property
    def root_link(self) -> str:
        """The veth end in the test process's namespace (names are at most 15 characters)."""
        return "pm" + self.run.replace("-", "")

    def _plug(self, port: str) -> None:
        ip("-n", self.bridge_ns, "link", "set", port, "master", "br0")
        ip("-n", self.bridge_ns, "link", "set", port, "up")

    def add_host(self, name: str) -> Host:
        index = len(self.hosts) + 2
        host = Host(name, f"{PREFIX}-{self.run}-{name}", f"10.77.{self.subnet}.{index}")
        ip("netns", "add", host.ns)
        port = f"p{index}"
        ip("-n", host.ns, "link", "add", "eth0", "type", "veth", "peer", "name", port,
           "netns", self.bridge_ns)
        self._plug(port)
        ip("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        ip("-n", host.ns, "link", "set", "eth0", "up")
        ip("-n", host.ns, "link", "set", "lo", "up")
        self.hosts[name] = host
        return host

    # ---- processes --------------------------------------------------------------------
    def start(self, role: str, host: Host, tmp: Path, *args: str, name: str | None = None,
              wait: bool = True) -> NsProc:
        """pdserve ``role`` in ``host`` on its default ports (each host has its own), bound to
        0.0.0.0 and advertising the host's address."""
        name = name or host.name
        if role == "proxy":
            port, kv_port = ProxyConfig().port, ProxyConfig().registry_port
        else:
            port, kv_port = ROLE_HTTP_PORTS[role], ROLE_KV_PORTS[role]
        cmd = [sys.executable, "-m", MODULES[role]]
        if role == "both":
            cmd.append("serve")
        cmd += ["--host", "0.0.0.0", "--port", str(port)]
        if role != "both":  # the bed is keyless: its namespaces are a network the tests trust
            cmd.append("--insecure-keyless-network")
        if role in ("prefill", "decode", "both"):
            cmd += ["--kv-host", host.ip, "--kv-port", str(kv_port)]
        else:
            cmd += ["--registry-host", "0.0.0.0", "--registry-port", str(kv_port)]
        cmd += list(args)
        env = node_env()
        log = tmp / f"{name}.log"
        open(log, "wb").close()
        popen = zygote.spawn(cmd, log, env, ROOT, netns=host.ns)  # forked into the namespace (helpers/zygote.py)
        if popen is None:
            with open(log, "ab") as out:
                popen = subprocess.Popen(["ip", "netns", "exec", host.ns, *cmd], stdout=out, stderr=subprocess.STDOUT,
                                         env=env, cwd=ROOT, start_new_session=True)
        proc = NsProc(name, popen, port, log, kv_port, list(args), host=host)
        self.procs.append(proc)
        if wait:
            proc.wait_ready()
        return proc

    # ---- faults -----------------------------------------------------------------------
    def cut(self, a: Host, b: Host, both_ways: bool = True) -> None:
        """Silently drop what ``a`` sends to ``b`` (and ``b`` to ``a`` when ``both_ways``)."""
        for src, dst in [(a, b), (b, a)][: 2 if both_ways else 1]:
            ip("-n", src.ns, "neigh", "replace", dst.ip, "lladdr", NOWHERE_MAC, "dev", "eth0",
               "nud", "permanent")

    def heal(self, a: Host, b: Host) -> None:
        for src, dst in [(a, b), (b, a)]:
            ip("-n", src.ns, "neigh", "del", dst.ip, "dev", "eth0", check=False)

    def netem(self, a: Host, b: Host, spec: str) -> None:
        """``tc netem`` ``spec`` (e.g. "delay 50ms loss 1%") on ``a``'s packets to ``b`` only."""
        self._shape(a, b, "10gbit", ("netem", *spec.split()))

    def throttle(self, a: Host, b: Host, rate: str) -> None:
        """``a``'s packets to ``b`` leave at ``rate`` (e.g. "8mbit"): plain htb, no netem needed,
        so a transfer lasts long enough to be cut while its bytes are on the wire."""
        self._shape(a, b, rate, None)

    def _shape(self, a: Host, b: Host, rate: str, leaf: tuple[str, ...] | None) -> None:
        def tc(*args: str) -> None:
            subprocess.run(["ip", "netns", "exec", a.ns, "tc", *args], check=True, capture_output=True)

        # htb class 1:1 (default) passes everything else; 1:2 carries the traffic to b
        tc("qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1")
        tc("class", "replace", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb", "rate", "10gbit")
        tc("class", "replace", "dev", "eth0", "parent", "1:", "classid", "1:2", "htb", "rate", rate)
        if leaf is not None:
            tc("qdisc", "replace", "dev", "eth0", "parent", "1:2", "handle", "20:", *leaf)
        tc("filter", "replace", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
           "match", "ip", "dst", f"{b.ip}/32", "flowid", "1:2")

    def rx_bytes(self, host: Host) -> int:
        """Bytes ``host`` has received on its bridge link so far."""
        out = subprocess.run(["ip", "-n", host.ns, "-s", "-j", "link", "show", "eth0"], check=True,
                             capture_output=True, text=True).stdout
        return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])

    def delay_link(self, a: Host, b: Host, one_way_ms: float = 0.0, loss: float = 0.0,
                   mtu: int = 1500) -> DelayLink:
        """Until it is closed, ``a`` and ``b`` reach each other's address over a relayed link
        (TAP ``eth1`` in each) that holds every frame ``one_way_ms`` and drops a ``loss``
        fraction. A large ``mtu`` means fewer frames for the relay to copy."""
        script = str(Path(__file__).with_name("delay_relay.py"))
        relay = subprocess.Popen([sys.executable, script, a.ns, b.ns, "eth1", str(one_way_ms), str(loss)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        link = DelayLink(relay)
        self.links.append(link)
        if relay.stdout.readline().strip() != "ready":
            raise RuntimeError("the delay relay did not start")
        for src, dst in ((a, b), (b, a)):
            ip("-n", src.ns, "link", "set", "eth1", "mtu", str(mtu), "up")
            ip("-n", src.ns, "route", "add", f"{dst.ip}/32", "dev", "eth1", "src", src.ip)
            route = ip("-n", src.ns, "route", "get", dst.ip).stdout
            if " dev eth1 " not in route:
                raise RuntimeError(f"{src.name} -> {dst.name} does not take the relayed link: {route}")
        return link

    def clear_netem(self, a: Host) -> None:
        subprocess.run(["ip", "netns", "exec", a.ns, "tc", "qdisc", "del", "dev", "eth0", "root"],
                       capture_output=True)

    # ---- teardown ---------------------------------------------------------------------
    def close(self) -> None:
        """Stop every process, then delete every namespace (and with them every link)."""
        for proc in self.procs:
            proc.kill()
        for link in self.links:
            link.close()
        for host in self.hosts.values():
            ip("netns", "del", host.ns, check=False)
        ip("link", "del", self.root_link, check=False)
        ip("netns", "del", self.bridge_ns, check=False)


def netem_unavailable() -> str | None:
    """Why ``tc netem`` cannot be used here (a skip reason), or None."""
    if shutil.which("tc") is None:
        return "no `tc` command (iproute2)"
    probe = f"{PREFIX}-{os.getpid()}-netem"
    try:
        ip("netns", "add", probe)
        ip("-n", probe, "link", "add", "d0", "type", "veth", "peer", "name", "d1")
        r = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "d0", "root", "netem",
                            "delay", "1ms"], capture_output=True, text=True)
    finally:
        ip("netns", "del", probe, check=False)
    if r.returncode != 0:
        return f"no netem qdisc in this kernel (sch_netem): `tc qdisc add netem` says {r.stderr.strip()!r}"
    return None
