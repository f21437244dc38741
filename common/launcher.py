"""`pdserve up` / `pdserve down`: the three processes on loopback with one command.

``up`` checks that nothing of ours is running and every port is free, generates the
embedded model once (so the two daemons do not race to write it), starts proxy, prefill
and decode as detached process groups logging to ``<run-dir>/logs/<name>.log``, records
them in ``<run-dir>/pids.json`` and waits until each answers ``GET /ready`` with 200.
``down`` reads ``pids.json``, sends SIGTERM to each process group, SIGKILLs what is
left after a grace period and removes the file. Both are also plain functions
(``up(options)``, ``down(run_dir)``) so tests can call them in-process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from common.config import ROLE_HTTP_PORTS, ROLE_KV_PORTS
from proxy.config import ProxyConfig

LOOPBACK = "127.0.0.1"
PIDS_FILE = "pids.json"
SERVED_MODEL_NAME = "pdserve-tiny"


class LaunchError(Exception):
    """`pdserve up` cannot start, or a process it started failed to become ready."""


@dataclass(frozen=True)
class UpOptions:
    """Everything `pdserve up` needs; the ports default to each command's own defaults."""

    run_dir: Path = Path(".pdserve")
    proxy_port: int = ProxyConfig.model_fields["port"].default
    prefill_port: int = ROLE_HTTP_PORTS["prefill"]
    decode_port: int = ROLE_HTTP_PORTS["decode"]
    registry_port: int = ProxyConfig.model_fields["registry_port"].default
    prefill_kv_port: int = ROLE_KV_PORTS["prefill"]
    decode_kv_port: int = ROLE_KV_PORTS["decode"]
    model: str | None = None
    timeout: float = 120.0


@dataclass(frozen=True)
class ProcessSpec:
    """One process to start: its module, its HTTP port and every port it will bind."""

    name: str
    module: str
    port: int
    ports: tuple[int, ...]
    args: tuple[str, ...]


def process_specs(options: UpOptions, model_args: tuple[str, ...]) -> list[ProcessSpec]:
    """The proxy, prefill and decode command lines, in start order."""
    registry = f"{LOOPBACK}:{options.registry_port}"
    return [
        ProcessSpec(
            "proxy", "proxy", options.proxy_port,
            (options.proxy_port, options.registry_port),
            ("--host", LOOPBACK, "--port", str(options.proxy_port),
             "--registry-port", str(options.registry_port)),
        ),
        ProcessSpec(
            "prefill", "prefill_node", options.prefill_port,
            (options.prefill_port, options.prefill_kv_port),
            ("--port", str(options.prefill_port), "--kv-port", str(options.prefill_kv_port),
             "--proxy", registry, *model_args),
        ),
        ProcessSpec(
            "decode", "decode_node", options.decode_port,
            (options.decode_port, options.decode_kv_port),
            ("--port", str(options.decode_port), "--kv-port", str(options.decode_kv_port),
             "--proxy", registry, *model_args),
        ),
    ]


# ---------------------------------------------------------------------------- pids.json

def read_pids(run_dir: Path) -> list[dict]:
    """The entries of ``<run_dir>/pids.json``; empty when there is no such file."""
    path = run_dir / PIDS_FILE
    if not path.exists():
        return []
    try:
        entries = json.loads(path.read_text())
    except json.JSONDecodeError:
        return []
    return [e for e in entries if isinstance(e, dict) and isinstance(e.get("pid"), int)]


def write_pids(run_dir: Path, entries: list[dict]) -> None:
    path = run_dir / PIDS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=2) + "\n")
    tmp.replace(path)


def is_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie child is reaped here and counts as dead)."""
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)
        if reaped == pid:
            return False
    except ChildProcessError:
        pass  # not our child: only the kill(0) probe can tell
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_ours(entry: dict) -> bool:
    """Alive and still running the module we started (guards against pid reuse)."""
    pid = entry["pid"]
    if not is_alive(pid):
        return False
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not cmdline.exists():
        return True  # no /proc (macOS): trust the pid
    try:
        argv = cmdline.read_bytes().split(b"\0")
    except OSError:
        return False
    return entry.get("module", "").encode() in argv


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
        raise LaunchError(f"two processes were given the same port: {ports}")
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
    """The daemons' model flags; generates the embedded model first when it is the one."""
    if options.model:
        return ("--model", options.model)
    from common.model.embedded import EMBEDDED_MODEL_NAME, ensure_embedded_model  # torch: lazy

    # Both daemons load this one directory under the embedded model's public name.
    return ("--model", str(ensure_embedded_model()), "--served-model-name", EMBEDDED_MODEL_NAME)


def up(options: UpOptions) -> dict:
    """Start the three processes and wait until they are ready.

    Returns ``{"proxy_url": str, "processes": [{"name", "pid", "port", "module", "log"}]}``.
    Raises LaunchError (after stopping whatever it started) when anything fails.
    """
    run_dir = Path(options.run_dir)
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    check_can_start(run_dir, process_specs(options, ()))
    specs = process_specs(options, model_args(options))
    entries: list[dict] = []
    procs: list[subprocess.Popen] = []
    try:
        for spec in specs:
            proc = start_process(spec, log_dir)
            procs.append(proc)
            entries.append({"name": spec.name, "pid": proc.pid, "port": spec.port,
                            "module": spec.module, "log": str(log_dir / f"{spec.name}.log")})
            write_pids(run_dir, entries)
        wait_ready(specs, procs, log_dir, options.timeout)
    except BaseException:
        down(run_dir, quiet=True)
        raise
    return {"proxy_url": f"http://{LOOPBACK}:{options.proxy_port}", "processes": entries}


# ---------------------------------------------------------------------------- stop

def signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)  # start_new_session made pid the group id
    except (ProcessLookupError, PermissionError):
        pass


def down(run_dir: Path, grace: float = 10.0, quiet: bool = False) -> list[dict]:
    """Stop what ``pids.json`` names (SIGTERM, then SIGKILL after `grace` s).

    Returns the entries that were running; idempotent (nothing running -> []).
    """
    run_dir = Path(run_dir)
    running = [e for e in read_pids(run_dir) if is_ours(e)]
    for entry in running:
        signal_group(entry["pid"], signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(is_alive(e["pid"]) for e in running) and time.monotonic() < deadline:
        time.sleep(0.1)
    for entry in running:
        if is_alive(entry["pid"]):
            signal_group(entry["pid"], signal.SIGKILL)
            entry["killed"] = True
    while any(is_alive(e["pid"]) for e in running) and time.monotonic() < deadline + 5:
        time.sleep(0.05)
    (run_dir / PIDS_FILE).unlink(missing_ok=True)
    if not quiet:
        _print_stopped(run_dir, running)
    return running


def _print_stopped(run_dir: Path, running: list[dict]) -> None:
    if not running:
        print(f"pdserve: nothing running (no live processes in {run_dir / PIDS_FILE})")
    for entry in running:
        how = "killed" if entry.get("killed") else "stopped"
        print(f"pdserve: {how} {entry['name']} (pid {entry['pid']}, port {entry['port']})")


# ---------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up_p = sub.add_parser("up", help="start proxy + prefill + decode on loopback")
    up_p.add_argument("--run-dir", type=Path, default=UpOptions.run_dir,
                      help="where pids.json and logs/ go (default: .pdserve)")
    for name in ("proxy_port", "prefill_port", "decode_port", "registry_port", "prefill_kv_port", "decode_kv_port"):
        default = getattr(UpOptions, name)
        up_p.add_argument("--" + name.replace("_", "-"), type=int, default=default, help=f"default: {default}")
    up_p.add_argument("--model", default=None,
                      help="model directory (default: the embedded pdserve-tiny model)")
    up_p.add_argument("--timeout", type=float, default=120.0,
                      help="seconds to wait for all three to be ready (default: 120)")
    down_p = sub.add_parser("down", help="stop what `pdserve up` started")
    down_p.add_argument("--run-dir", type=Path, default=UpOptions.run_dir)
    return parser


def served_model_name(proxy_url: str) -> str:
    """The first model the proxy lists (the embedded model's name if it lists none)."""
    try:
        with urllib.request.urlopen(f"{proxy_url}/v1/models", timeout=5) as response:
            return json.loads(response.read())["data"][0]["id"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError):
        return SERVED_MODEL_NAME


def print_started(result: dict, run_dir: Path) -> None:
    url = result["proxy_url"]
    for entry in result["processes"]:
        print(f"pdserve: {entry['name']:<8} pid {entry['pid']:<7} port {entry['port']:<6} "
              f"log {entry['log']}")
    body = json.dumps({"model": served_model_name(url), "max_tokens": 16,
                       "messages": [{"role": "user", "content": "Hello"}]})
    print(f"\nReady. OpenAI API at {url}/v1\n\n"
          f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
          f"    -d '{body}'\n\n"
          f"Stop with: pdserve down --run-dir {run_dir}")


def main(argv: list[str] | None = None) -> int:
    """Entry point for `pdserve up|down ...`; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.command == "down":
        down(args.run_dir)
        return 0
    options = UpOptions(
        run_dir=args.run_dir, proxy_port=args.proxy_port, prefill_port=args.prefill_port,
        decode_port=args.decode_port, registry_port=args.registry_port,
        prefill_kv_port=args.prefill_kv_port, decode_kv_port=args.decode_kv_port,
        model=args.model, timeout=args.timeout,
    )
    try:
        result = up(options)
    except LaunchError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pdserve up: interrupted; stopped what had started", file=sys.stderr)
        return 130
    print_started(result, args.run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
