"""What every process checks before it loads anything, and how a failed start is reported.

A start that cannot succeed (a port taken, a checkpoint the loader refuses, ``--device cuda``
on a machine without CUDA, a cluster key file that went away) prints one line,
``pdserve <command>: error: <what is wrong>``, and exits 1; a bad option value was already
refused with exit 2 when the flags were read (common/options.py). Ports are checked first, so
a node whose port is taken says so before it spends minutes loading a model.

Keyless is loopback only (:func:`check_keyless_binds`): a daemon or proxy without a cluster key
that would listen on any other address refuses to start unless ``--insecure-keyless-network``
says the network is trusted.
"""

from __future__ import annotations

import errno
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from common.cluster_auth import is_loopback

START_FAILED_EXIT_CODE = 1


class StartupError(Exception):
    """This process cannot start here; the message says why and what to change."""


def check_port_free(host: str, port: int, option: str) -> None:
    """StartupError unless ``host:port`` can be bound now (``option`` is the flag that set it).

    Bound with SO_REUSEADDR, as uvicorn and ZMQ bind, so a port a stopped process left in
    TIME_WAIT counts as free and only a listening one as taken. Port 0 (any free port) is free."""
    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise StartupError(f"{option}: cannot bind {host}:{port}: {exc.strerror}") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            in_use = exc.errno == errno.EADDRINUSE
            problem = "is in use by another process" if in_use else f"cannot be bound ({exc.strerror})"
            raise StartupError(f"{option}: port {port} on {host} {problem}; stop that process or "
                               f"choose another {option}") from None


def check_keyless_binds(keyed: bool, insecure: bool, addresses: dict[str, str]) -> None:
    """StartupError when a keyless process would listen on a non-loopback address.

    ``addresses`` maps each option to the address it makes this process listen on (a daemon's
    data-plane pairs listen on ``--kv-host``). Without a key anyone who reaches those ports can
    register nodes, send requests past the proxy's API key and make a daemon connect anywhere,
    so only ``--insecure-keyless-network`` (a network you trust) lets it start there."""
    if keyed or insecure:
        return
    open_ = [f"{option} {host or '0.0.0.0'}" for option, host in addresses.items() if not is_loopback(host)]
    if open_:
        verb = "is" if len(open_) == 1 else "are"
        raise StartupError(f"{', '.join(open_)} {verb} not loopback and no --cluster-key-file is set: without a "
                           "key anyone who reaches these ports can register nodes, send requests past the API "
                           "key and make this process connect anywhere; set --cluster-key-file (the same file "
                           "on the proxy and every daemon), or pass --insecure-keyless-network on a network "
                           "you trust")


def _reported_failures() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "cannot start here" (imported late: they live beside torch)."""
    from common.cluster_auth import ClusterKeyError
    from common.engine.config import EngineConfigError
    from common.engine.gpu_memory import GpuMemoryError
    from common.engine.tp_group import RankLostError
    from common.model.attention import TritonStartError
    from common.model.batch_invariant import BatchInvariantError
    from common.model.config import ModelLoadError

    return (StartupError, ModelLoadError, EngineConfigError, GpuMemoryError, TritonStartError, ClusterKeyError,
            RankLostError, BatchInvariantError)  # a tensor-parallel worker died while the node started (its own log says why)


@contextmanager
def one_line_failures(prog: str) -> Iterator[None]:
    """Report a failed start as ``prog: error: ...`` on stderr and exit 1, not as a traceback."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, StartupError) or isinstance(exc, _reported_failures()):
            message = " ".join(str(exc).split())  # one line, whatever the message held
            sys.stderr.write(f"{prog}: error: {message}\n")
            raise SystemExit(START_FAILED_EXIT_CODE) from None
        raise
