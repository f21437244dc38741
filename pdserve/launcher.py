"""`pdserve up` / `pdserve down`: the three processes on loopback with one command.

``up`` checks that nothing of ours is running and every port is free, resolves ``--model`` once
(fetches and converts the default model, converts a GGUF or generates the embedded model, so the
two daemons do not race to do it), starts proxy, prefill
and decode as detached process groups logging to ``<run-dir>/logs/<name>.log``, records
them in ``<run-dir>/pids.json`` and waits until each answers ``GET /ready`` with 200.
Any exception (a signal turned into one included) before that stops whatever had started.
With ``--tensor-parallel-size N`` each daemon runs N processes (itself, rank 0, and N - 1
``common.kv_transfer.tp_rank_main`` children in its process group) and binds KV ports kv-port ..
kv-port + N - 1; ``up`` checks all of them, and ``down`` stops the whole group.
``--prefill-nodes`` / ``--decode-nodes`` start more daemons of a role (node i at its role's ports + i);
with ``--planner on`` the daemons run as ``pdserve prefill|decode``, which the proxy's planner can flip.
``down`` is in :mod:`pdserve.run_dir`; the command line in :mod:`pdserve.launcher_cli`. Both
are plain functions (``up(options)``, ``down(run_dir)``) so tests can call them in-process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from common.cluster_auth import ClusterKey
from common.defaults import DEFAULT_CACHE_DIR
from common.config import (
    PROXY_HTTP_PORT, PROXY_REGISTRY_PORT, ROLE_HTTP_PORTS, ROLE_KV_PORTS,
)
from common.kv_topology import MAX_TP_SIZE
from pdserve.run_dir import PIDS_FILE, down, is_alive, is_ours, read_pids, write_pids

# down / is_alive / read_pids are re-exported: callers of `up` and `down` need only this module
__all__ = ["LaunchError", "ProcessSpec", "UpOptions", "auto_decode_kv_port", "down", "is_alive",
           "process_specs", "read_pids", "tp_mismatch", "up"]

LOOPBACK = "127.0.0.1"
CLUSTER_KEY_FILE = "cluster.key"  # a fresh one per `up`, mode 0600, given to all three


class LaunchError(Exception):
    """`pdserve up` cannot start, or a process it started failed to become ready."""


@dataclass(frozen=True)
class UpOptions:
    """Everything `pdserve up` needs; the ports default to each command's own defaults."""

    run_dir: Path = Path(".pdserve")
    proxy_port: int = PROXY_HTTP_PORT
    prefill_port: int = ROLE_HTTP_PORTS["prefill"]
    decode_port: int = ROLE_HTTP_PORTS["decode"]
    registry_port: int = PROXY_REGISTRY_PORT
    prefill_kv_port: int = ROLE_KV_PORTS["prefill"]
    decode_kv_port: int = ROLE_KV_PORTS["decode"]
    model: str | None = None
    timeout: float = 120.0
    prefill_tp: int = 1  # --tensor-parallel-size of each daemon: one divides the other (tp_mismatch)
    decode_tp: int = 1
    # daemons of each role (node i at its role's ports + i; KV ports kv-port + i x its KV ranks): more
    # than one pair gives --planner nodes to move between the roles
    prefill_nodes: int = 1
    decode_nodes: int = 1
    # run the daemons as ``pdserve prefill|decode`` (pdserve/daemon.py: they can flip their role in place,
    # what --planner on asks of them) instead of ``python -m prefill_node|decode_node`` (one role each)
    flippable: bool = False
    # appended to each process's own flags (pass_through.py checks them first)
    proxy_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()

    @property
    def prefill_kv_ranks(self) -> int:
        """The prefill node's KV endpoints: one per rank, or the decode node's TP size when that is
        larger (``--kv-ranks``: each prefill rank's heads cut into slices, one per decode rank)."""
        return max(self.prefill_tp, self.decode_tp)


PORT_FLAGS = ("proxy_port", "prefill_port", "decode_port", "registry_port", "prefill_kv_port",
              "decode_kv_port")


def tp_mismatch(prefill_tp: int, decode_tp: int) -> str | None:
    """Why these TP sizes cannot run together, or None. A decode rank reads whole KV ranks of the
    prefill node (``tp_routes``), and the prefill node presents as many KV ranks as the larger of
    the two sizes (``--kv-ranks``, ``tp_slices``): one size must divide the other. Whether the
    model's KV heads divide too is the daemons' and the proxy's check (it needs the model)."""
    for name, size in (("prefill", prefill_tp), ("decode", decode_tp)):
        if not 1 <= size <= MAX_TP_SIZE:
            return f"the {name} tensor-parallel size must be between 1 and {MAX_TP_SIZE} (got {size})"
    if prefill_tp % decode_tp and decode_tp % prefill_tp:
        return (f"prefill and decode tensor-parallel sizes must divide one another (got {prefill_tp} and "
                f"{decode_tp}): each decode rank reads whole KV ranks of the prefill node")
    return None


def auto_decode_kv_port(prefill_kv_port: int, prefill_tp: int, decode_tp: int) -> int:
    """Decode's first KV port when none was chosen: its default, or the port after prefill's KV
    ports (kv-port + rank; ``prefill_tp``: its KV ranks) when the two ranges would overlap (the
    defaults are adjacent)."""
    default = ROLE_KV_PORTS["decode"]
    if prefill_kv_port < default + decode_tp and default < prefill_kv_port + prefill_tp:
        return prefill_kv_port + prefill_tp
    return default


def kv_ports(first: int, tp: int) -> tuple[int, ...]:
    """A daemon's KV endpoints: one per KV rank, at kv-port + rank."""
    return tuple(range(first, first + tp))


@dataclass(frozen=True)
class ProcessSpec:
    """One process to start: its module, its HTTP port and every port it will bind."""

    name: str
    module: str
    port: int
    ports: tuple[int, ...]
    args: tuple[str, ...]


# Everything `up` starts listens on loopback only: a router there (or the README's curl pair) may speak
# kv_transfer_params to the daemons, though no proxy signs its ids (--no-accept-... through --node-arg undoes it)
KV_PARAMS_ON_LOOPBACK = ("--accept-unsigned-kv-transfer-params",)


def process_specs(options: UpOptions, model_args: tuple[str, ...]) -> list[ProcessSpec]:
    """The proxy, prefill and decode command lines, in start order (``prefill``, ``prefill-1``, ...)."""
    registry = f"{LOOPBACK}:{options.registry_port}"
    specs = [
        ProcessSpec(
            "proxy", "proxy", options.proxy_port,
            (options.proxy_port, options.registry_port),
            ("--host", LOOPBACK, "--port", str(options.proxy_port),
             "--registry-port", str(options.registry_port), *options.proxy_args),
        ),
    ]
    roles = (("prefill", options.prefill_nodes, options.prefill_port, options.prefill_kv_port, options.prefill_kv_ranks,
              options.prefill_tp, ("--kv-ranks", str(options.prefill_kv_ranks)), options.prefill_args),
             ("decode", options.decode_nodes, options.decode_port, options.decode_kv_port, options.decode_tp,
              options.decode_tp, (), options.decode_args))
    for role, count, first_port, first_kv_port, ranks, tp, role_args, extra in roles:
        module, command = ("pdserve.cli", (role,)) if options.flippable else (f"{role}_node", ())
        for i in range(count):
            port, kv_port = first_port + i, first_kv_port + i * ranks
            specs.append(ProcessSpec(
                f"{role}-{i}" if i else role, module, port, (port, *kv_ports(kv_port, ranks)),
                (*command, "--port", str(port), "--kv-port", str(kv_port), "--tensor-parallel-size", str(tp),
                 *role_args, "--proxy", registry, *model_args, *KV_PARAMS_ON_LOOPBACK, *extra),
            ))
    return specs


# ---------------------------------------------------------------------------- checks

def port_in_use(port: int, host: str = "0.0.0.0") -> bool:
    """True when binding `port` fails, i.e. someone already listens on it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Like the servers we start: a port in TIME_WAIT is free, a listener is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def check_can_start(run_dir: Path, specs: list[ProcessSpec]) -> None:
    """Raise LaunchError when our processes already run or a port is taken."""
    running = [e for e in read_pids(run_dir) if is_ours(e)]
    if running:
        names = ", ".join(f"{e['name']} (pid {e['pid']})" for e in running)
        raise LaunchError(f"already running from {run_dir}: {names}; run `pdserve down` first")
    (run_dir / PIDS_FILE).unlink(missing_ok=True)  # stale: nothing in it is alive
    ports = [p for spec in specs for p in spec.ports]
    if len(set(ports)) != len(ports):
        named = ", ".join(f"{spec.name} {list(spec.ports)}" for spec in specs)
        raise LaunchError(f"two processes were given the same port (a daemon's KV ports are "
                          f"kv-port .. kv-port + tensor-parallel-size - 1): {named}")
    taken = [f"{p} ({spec.name})" for spec in specs for p in spec.ports if port_in_use(p)]
    if taken:
        raise LaunchError(f"port already in use: {', '.join(taken)}; stop what holds it "
                          "or choose other ports (see `pdserve up --help`)")


# ---------------------------------------------------------------------------- start / wait

def start_process(spec: ProcessSpec, log_dir: Path) -> subprocess.Popen:
    """Start one detached process group whose output goes to its own log file."""
    log_path = log_dir / f"{spec.name}.log"
    log_path.write_bytes(b"")  # this run's log only, so a failure shows its own tail
    # No --log-file: the process logs to stderr, which lands here with any traceback;
    # both at once would write every line twice.
    cmd = [sys.executable, "-m", spec.module, *spec.args]
    # Children import the same pdserve as this launcher, whatever the working directory.
    package_root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,  # own process group: `down` signals it as a whole
        )


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def log_tail(path: Path, lines: int = 30) -> str:
    if not path.exists():
        return "(no log written)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_ready(specs: list[ProcessSpec], procs: list[subprocess.Popen],
               log_dir: Path, timeout: float) -> None:
    """Poll every /ready until all answer 200; raise LaunchError naming the culprit."""
    deadline = time.monotonic() + timeout
    pending = {spec.name: (spec, proc) for spec, proc in zip(specs, procs)}
    while pending:
        for name, (spec, proc) in list(pending.items()):
            if proc.poll() is not None:
                raise LaunchError(_failure(spec, log_dir, f"exited with code {proc.returncode}"))
            if http_ok(f"http://{LOOPBACK}:{spec.port}/ready"):
                del pending[name]
        if pending and time.monotonic() > deadline:
            spec = next(iter(pending.values()))[0]
            raise LaunchError(_failure(spec, log_dir, f"not ready after {timeout:g} s"))
        if pending:
            time.sleep(0.25)


def _failure(spec: ProcessSpec, log_dir: Path, why: str) -> str:
    log_path = log_dir / f"{spec.name}.log"
    return (f"{spec.name} failed to start: {why}\n--- last lines of {log_path} ---\n"
            f"{log_tail(log_path)}")


def model_args(options: UpOptions) -> tuple[str, ...]:
    """The daemons' model flags: the model fetched, converted or generated here first, once, so
    the two daemons do not race to do it (and a download's progress shows in this terminal)."""
    from common.model.sources import resolve_model  # torch for the embedded model: lazy

    model_dir, name = resolve_model(options.model, DEFAULT_CACHE_DIR)
    return ("--model", str(model_dir), "--served-model-name", name)


def memory_args(tp: int = 1, daemons: int = 2) -> tuple[str, ...]:
    """Every daemon lands on the first GPU when there is one (rank r of each on cuda:r with
    tensor parallelism): each gets its share (1 / ``daemons``) of the default of every device it uses."""
    import torch  # lazy: `pdserve down` and the CPU path need no torch here

    from common.engine.gpu_memory import split_share

    if not torch.cuda.is_available():
        return ()
    if torch.cuda.device_count() < tp:
        raise LaunchError(f"--tensor-parallel-size {tp} needs {tp} CUDA devices (one per rank); "
                          f"this machine has {torch.cuda.device_count()}")
    return ("--gpu-memory-utilization", str(split_share(daemons)))


def up(options: UpOptions) -> dict:
    """Start the three processes and wait until they are ready.

    Returns ``{"proxy_url": str, "processes": [{"name", "pid", "port", "module", "log"}]}``.
    Raises LaunchError (after stopping whatever it started) when anything fails.
    """
    why = tp_mismatch(options.prefill_tp, options.decode_tp)
    if why:
        raise LaunchError(why)
    run_dir = Path(options.run_dir)
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    check_can_start(run_dir, process_specs(options, ()))
    key_args = ("--cluster-key-file", str(ClusterKey.generate(run_dir / CLUSTER_KEY_FILE).resolve()))
    specs = [replace(s, args=(*s.args, *key_args))
             for s in process_specs(options, model_args(options)
                                    + memory_args(options.prefill_tp, options.prefill_nodes + options.decode_nodes))]
    entries: list[dict] = []
    procs: list[subprocess.Popen] = []
    try:
        for spec in specs:
            proc = start_process(spec, log_dir)
            procs.append(proc)
            entries.append(_pids_entry(spec, proc, log_dir))
            write_pids(run_dir, entries)
        wait_ready(specs, procs, log_dir, options.timeout)
    except BaseException:
        # a signal may have landed between a start and its record
        write_pids(run_dir, [_pids_entry(spec, proc, log_dir) for spec, proc in zip(specs, procs)])
        down(run_dir, quiet=True)
        raise
    return {"proxy_url": f"http://{LOOPBACK}:{options.proxy_port}", "processes": entries}


def _pids_entry(spec: ProcessSpec, proc: subprocess.Popen, log_dir: Path) -> dict:
    return {"name": spec.name, "pid": proc.pid, "port": spec.port, "ports": list(spec.ports),
            "module": spec.module, "log": str(log_dir / f"{spec.name}.log")}
