"""Real pdserve processes for tests: start a node or proxy, wait until ready, stop it.

Each process logs to a file under the test's tmp dir; a process that dies or never
gets ready fails the test with the tail of its log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from helpers import zygote
from helpers.ports import free_port, free_port_run

ROOT = Path(__file__).resolve().parents[2]
MODULES = {"both": "pdserve.cli", "prefill": "prefill_node", "decode": "decode_node", "proxy": "proxy"}


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen | zygote.Forked
    port: int
    log: Path
    kv_port: int | None = None
    args: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)  # the whole command line (``restart`` runs it again)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_addr(self) -> str:
        return f"127.0.0.1:{self.kv_port}"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no log)"

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until /ready says 200 from this process: /health's pid must be ours, so another process
        answering on the port (one that got the same port) is not taken for it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    pid = httpx.get(self.url + "/health", timeout=2).json().get("pid", self.popen.pid)
                    if pid != self.popen.pid:
                        raise RuntimeError(f"{self.name}: port {self.port} is answered by pid {pid}, not by the "
                                           f"process started ({self.popen.pid}):\n{self.log_tail()}")
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not ready after {timeout} s:\n{self.log_tail()}")

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self, timeout: float = 20.0) -> None:
        stop_all([self], timeout)


@contextlib.contextmanager
def all_ready(procs: dict[str, Proc]) -> Iterator[dict[str, Proc]]:
    """``procs`` (started with ``wait=False``, so their start-ups overlap) once every one is ready;
    all stopped on the way out, a start that failed included."""
    try:
        for proc in procs.values():
            proc.wait_ready()
        yield procs
    finally:
        stop_all(procs.values())


def stop_all(procs: Iterable[Proc], timeout: float = 20.0) -> None:
    """SIGTERM to every process at once, then each waited for (killed after ``timeout``)."""
    procs = list(procs)
    for proc in procs:
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()


def start(role: str, tmp: Path, *args: str, name: str | None = None, wait: bool = True) -> Proc:
    """Start ``role`` (both | prefill | decode | proxy) on free ports with ``args`` appended."""
    name = name or role
    port = free_port()
    log = tmp / f"{name}.log"
    kv_port = None
    cmd = [sys.executable, "-m", MODULES[role]]
    if role == "both":
        cmd.append("serve")
    cmd += ["--port", str(port)]
    if role in ("prefill", "decode"):
        ranks = max([1] + [int(args[i + 1]) for i, a in enumerate(args) if a in ("--tensor-parallel-size",
                                                                                 "--kv-ranks")])
        kv_port = free_port_run(ranks)  # KV rank r's endpoint is at kv_port + r
        cmd += ["--kv-port", str(kv_port)]
    if role == "proxy":
        cmd += ["--registry-port", str(kv_port := free_port())]
    cmd += list(args)
    proc = Proc(name, _spawn(cmd, log, "wb"), port, log, kv_port, list(args), cmd)
    return _ready(proc) if wait else proc


def node_env() -> dict[str, str]:
    """A node's environment: this one, single-threaded BLAS, and the checkout first on ``PYTHONPATH``
    in front of what was there (a GPU machine's pip-installed ``--target`` directory, say)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")


def _spawn(cmd: list[str], log: Path, mode: str) -> subprocess.Popen | zygote.Forked:
    """``cmd`` started as its own session, logging to ``log``: forked by the test process's zygote
    (helpers/zygote.py: the libraries are imported once), or a plain Popen with ``PDSERVE_TEST_FORK=0``."""
    env = node_env()
    open(log, mode).close()  # there (and empty unless appending) once this returns, as Popen's would be
    forked = zygote.spawn(cmd, log, env, ROOT)
    if forked is not None:
        return forked
    with open(log, mode) as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)


def _ready(proc: Proc) -> Proc:
    try:
        proc.wait_ready()
    except BaseException:
        proc.kill()
        raise
    return proc


def restart(proc: Proc, wait: bool = True) -> Proc:
    """``proc`` (dead) started again with its command line: the same ports, its log appended to. A
    port another process took meanwhile fails the start, as it would in production."""
    assert proc.popen.poll() is not None, f"{proc.name} is still running"
    proc.popen = _spawn(proc.cmd, proc.log, "ab")
    return _ready(proc) if wait else proc


def static_nodes(procs: dict[str, Proc], model: str = "pdserve-tiny") -> tuple[str, ...]:
    """Proxy flags listing ``procs``' prefill and decode daemons statically: a second proxy, with
    flags of its own, in front of daemons registered elsewhere."""
    p, d = procs["prefill"], procs["decode"]
    return ("--static-prefill", f"127.0.0.1:{p.port}@{p.kv_addr}@{model}",
            "--static-decode", f"127.0.0.1:{d.port}@{d.kv_addr}@{model}")


def metrics(base_url: str, *names: str) -> list[float]:
    """The values of un-labelled-by-extra-keys series, e.g. ``pdserve:kv_cache_usage_perc``, from one
    scrape of ``/metrics``."""
    text = httpx.get(base_url + "/metrics", timeout=5).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names and name not in found:
            found[name] = float(line.rsplit(" ", 1)[1])
    missing = [name for name in names if name not in found]
    if missing:
        raise KeyError(f"{missing} not in /metrics of {base_url}")
    return [found[name] for name in names]


def metric(base_url: str, name: str) -> float:
    """The value of one un-labelled-by-extra-keys series, e.g. ``pdserve:kv_cache_usage_perc``."""
    return metrics(base_url, name)[0]


def labelled(base_url: str, name: str, **labels: str) -> float:
    """The value of the series ``name`` with ``labels`` (0 when there is none yet)."""
    text = httpx.get(base_url + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_idle(base_url: str, timeout: float = 30.0) -> None:
    """Until the node reports no running request and no used KV block."""
    deadline = time.monotonic() + timeout
    while True:
        usage, running, waiting = metrics(base_url, "pdserve:kv_cache_usage_perc", "pdserve:num_requests_running",
                                          "pdserve:num_requests_waiting")
        if usage == 0 and running == 0 and waiting == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{base_url} not idle: usage {usage}, running {running}, waiting {waiting}")
        time.sleep(0.05)


@contextlib.contextmanager
def pd_cluster(tmp: Path, proxy_args: tuple[str, ...] = (), node_args: tuple[str, ...] = (),
               colocated_args: tuple[str, ...] | None = ()) -> Iterator[dict[str, Proc]]:
    """A proxy with a prefill and a decode daemon registered (heartbeats every 0.5 s) and, unless
    ``colocated_args`` is None, a colocated node: ``{"proxy", "prefill", "decode"[, "both"]}``."""
    procs: dict[str, Proc] = {}
    try:
        proxy = procs["proxy"] = start("proxy", tmp, *proxy_args, wait=False)
        for role in ("prefill", "decode"):  # started together: model loads overlap
            procs[role] = start(role, tmp, "--proxy", f"127.0.0.1:{proxy.kv_port}",
                                "--heartbeat-interval-s", "0.5", *node_args, wait=False)
        if colocated_args is not None:
            procs["both"] = start("both", tmp, *colocated_args, wait=False)
        for proc in [p for p in procs.values() if p is not proxy]:
            proc.wait_ready()  # a node that dies starting fails here with its log
        proxy.wait_ready(timeout=60)  # ready = a compatible P and D registered
        yield procs
    finally:
        stop_all(procs.values())
