"""Heartbeats to every proxy of the cluster: any number of proxies, all active.

A daemon registers with each address ``--proxy`` stands for (common/proxy_addresses.py) through
a :class:`~common.registry_client.Heartbeater` of that address's own (one thread each). Each
proxy builds its view of the cluster from what the daemons send it; no proxy needs another, and
with one cluster key any proxy's signed request ids are good at every daemon.

Who is heartbeated, over time:

- an IP literal: from start to stop. A proxy that restarts there is reconnected to within half a
  heartbeat interval and hears from this node within one heartbeat of listening again;
- a DNS name: its addresses, resolved again every ``--proxy-resolve-interval-s`` (default 2 s, the
  default heartbeat interval) by the ``pdserve-proxy-dns`` thread, started only when there is a
  name. An address that appears gets a heartbeater at once (its first beat goes out then); one
  that is gone gets a goodbye and no more beats. A failed resolution keeps the addresses the name
  had (a DNS hiccup must not drop live proxies); a name that never resolved is tried every
  heartbeat interval until it does (a compose service whose proxies are not up yet).

What the registries answer (the peer KV addresses this node may pair with: a decode node's prefill
nodes, a keyless prefill node's decode nodes) is merged in :attr:`ProxyHeartbeats.members`: the
union of the answers of the proxies that answered within the last ``FRESH_BEATS`` heartbeat
intervals, so a killed proxy's last answer stops counting as the proxies stop counting a silent
node; when none did, the union of every last answer (what one proxy's last answer was before:
the best known); None until any proxy answered (or when none answers: vLLM's registry). The
answers' ``peers`` (``--kv-peer-fetch``) merge the same way in :attr:`ProxyHeartbeats.peers`
(empty, not None, when none named any).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from common.cluster_auth import ClusterKey
from common.proxy_addresses import MAX_PROXY_ADDRESSES, GetAddrInfo, ProxyEntry, resolve
from common.registry_client import Heartbeater

logger = logging.getLogger(__name__)

FRESH_BEATS = 3.0  # an answer older than this many heartbeat intervals is stale (the proxies evict after 3)


class ProxyHeartbeats:
    """One :class:`Heartbeater` per proxy address, kept in step with ``--proxy``'s resolution.
    Reads like one Heartbeater: ``members``, ``member_tp_sizes``, ``peers``, ``beats_sent``, ``start``, ``stop``."""

    def __init__(self, entries: tuple[ProxyEntry, ...], info: Callable[[], dict], interval_s: float = 2.0,
                 resolve_interval_s: float = 2.0, key: ClusterKey | None = None,
                 getaddrinfo: GetAddrInfo = socket.getaddrinfo) -> None:
        self.entries = entries
        self.interval_s = interval_s
        self.resolve_interval_s = resolve_interval_s
        self._info, self._key, self._getaddrinfo = info, key, getaddrinfo
        self._resolved: dict[ProxyEntry, tuple[str, ...]] = {}  # each entry's last good resolution
        self._failing: set[ProxyEntry] = set()  # names whose last resolution failed (logged once)
        self._beats: dict[str, Heartbeater] = {}  # address -> its heartbeater; replaced whole, read lock-free
        self._lock = threading.Lock()  # one refresh at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- what the daemon reads --------------------------------------------------------
    @property
    def addresses(self) -> list[str]:
        """The proxy addresses heartbeated now."""
        return sorted(self._beats)

    @property
    def beats_sent(self) -> int:
        return sum(b.beats_sent for b in self._beats.values())

    @property
    def answering(self) -> list[str]:
        """The proxy addresses that answered within the last ``FRESH_BEATS`` heartbeat intervals."""
        return sorted(b.proxy_address for b in self._fresh(list(self._beats.values())))

    def _fresh(self, beats: list[Heartbeater]) -> list[Heartbeater]:
        now = time.monotonic()
        return [b for b in beats if b.answered_at is not None and now - b.answered_at <= FRESH_BEATS * self.interval_s]

    def _answered(self) -> list[Heartbeater]:
        """The heartbeaters whose answer counts: those answered recently, or else all that ever did."""
        beats = list(self._beats.values())
        return self._fresh(beats) or [b for b in beats if b.members is not None]

    @property
    def members(self) -> frozenset[str] | None:
        """The union of the registries' answers (module docstring); None when none answered."""
        answered = self._answered()
        if not answered:
            return None
        return frozenset().union(*(b.members or () for b in answered))

    @property
    def peers(self) -> frozenset[str]:
        """The union of the answering registries' ``peers`` (``--kv-peer-fetch``: the nodes whose
        prefix blocks this node may fetch); empty when none named any."""
        return frozenset().union(*(b.peers for b in self._answered()))

    @property
    def member_tp_sizes(self) -> dict[str, int]:
        """Of ``members``, the ones with more than one KV rank, as their registries said."""
        sizes: dict[str, int] = {}
        for beat in self._answered():
            sizes.update(beat.member_tp_sizes)
        return sizes

    def nudge(self) -> None:
        """Beat every proxy now (a role flip's state changed: common/node/role_flip.py)."""
        for beat in list(self._beats.values()):
            beat.nudge()

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Heartbeat the IP literals at once; resolve the names (if any) on a thread of their own."""
        self._refresh(names=False)
        if any(entry.is_name for entry in self.entries):
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="pdserve-proxy-dns", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop resolving, then every heartbeater (each says goodbye to its proxy)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)  # a lookup still blocked past this adds nothing (_refresh)
            self._thread = None
        with self._lock:
            beats, self._beats = list(self._beats.values()), {}
        _stop_all(beats)

    def refresh(self) -> None:
        """Resolve every name once and heartbeat exactly the addresses it gave (tests call it)."""
        self._refresh(names=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._refresh(names=True)
            unresolved = any(e.is_name and e not in self._resolved for e in self.entries)
            self._stop.wait(min(self.resolve_interval_s, self.interval_s) if unresolved else self.resolve_interval_s)

    def _refresh(self, names: bool) -> None:
        # looked up outside the lock: a DNS query may block for seconds, and stop() takes the lock
        found = {e: _lookup(e, self._getaddrinfo) for e in self.entries if names or not e.is_name}
        with self._lock:
            if self._stop.is_set():
                return  # stopping: stop() stops the heartbeaters there are, and no new one may start
            for entry, addresses in found.items():
                self._record(entry, addresses)
            wanted = list(dict.fromkeys(a for e in self.entries for a in self._resolved.get(e, ())))
            if len(wanted) > MAX_PROXY_ADDRESSES:
                logger.warning("--proxy stands for %d addresses; heartbeating the first %d", len(wanted),
                               MAX_PROXY_ADDRESSES)
                wanted = wanted[:MAX_PROXY_ADDRESSES]
            gone = [b for a, b in self._beats.items() if a not in wanted]
            added = [a for a in wanted if a not in self._beats]
            beats = {a: b for a, b in self._beats.items() if a in wanted}
            for address in added:
                beats[address] = Heartbeater(address, self._info, self.interval_s, key=self._key)
                beats[address].start()
                logger.info("registering with the proxy at %s", address)
            self._beats = beats  # a new dict: readers on other threads see the old one or this one
        for beat in gone:
            logger.info("the proxy at %s is no longer named by --proxy: goodbye", beat.proxy_address)
        _stop_all(gone)

    def _record(self, entry: ProxyEntry, addresses: tuple[str, ...] | OSError) -> None:
        """Keep a lookup's addresses; a failed one keeps the entry's last (logged once per failure)."""
        if isinstance(addresses, OSError):
            if entry not in self._failing:
                self._failing.add(entry)
                kept = ", ".join(self._resolved.get(entry, ())) or "none yet"
                logger.warning("--proxy %s does not resolve (%s); heartbeating its last addresses: %s", entry,
                               addresses, kept)
            return
        self._failing.discard(entry)
        if entry.is_name and addresses != self._resolved.get(entry):
            logger.info("--proxy %s resolves to %s", entry, ", ".join(addresses))
        self._resolved[entry] = addresses


def _lookup(entry: ProxyEntry, getaddrinfo: GetAddrInfo) -> tuple[str, ...] | OSError:
    try:
        return resolve(entry, getaddrinfo)
    except OSError as exc:
        return exc


def _stop_all(beats: list[Heartbeater]) -> None:
    """Stop heartbeaters together: each goodbye may wait up to a second for its connection."""
    if len(beats) <= 1:
        for beat in beats:
            beat.stop()
        return
    threads = [threading.Thread(target=b.stop, name="pdserve-heartbeat-stop") for b in beats]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
