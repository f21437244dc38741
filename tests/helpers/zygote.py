"""Start test nodes by forking a process that has already imported the heavy libraries.

A node started as ``python -m decode_node`` spends ~1.5 s of CPU importing torch, FastAPI and the
rest before it runs a line of ours, and the suite starts a few hundred of them: on 2 cores that was
most of the suite's CPU. Each xdist worker (each test process) therefore keeps one *zygote*: a
single-threaded Python that imported those third-party libraries once (none of ours, whose imports
may read the environment) and forks a child per node. The child then becomes what ``python -m
<module> <args>`` would have been: its own session (``setsid``), stdout and stderr to the node's
log, stdin from /dev/null, the environment and working directory of the request, ``sys.argv`` and
``__main__`` set by :func:`runpy.run_module`; an exception or ``SystemExit`` leaves it as it would
leave ``python -m``. The zygote reaps its children and reports each exit status, so
:class:`Forked` answers ``poll``/``wait``/``returncode`` like the ``subprocess.Popen`` it stands in for.

``PDSERVE_TEST_FORK=0`` starts every node with a plain ``subprocess.Popen`` instead.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

# what a node imports that is not ours (~90 % of its import time); a missing one is skipped
PRELOAD = ("torch", "numpy", "fastapi", "starlette", "pydantic", "uvicorn", "httptools", "httpx", "jinja2",
           "llguidance", "msgpack", "prometheus_client", "safetensors", "tokenizers", "zmq", "uvloop")
_HEADER = struct.Struct("!I")


def _send(fd: int, obj: object) -> None:
    data = pickle.dumps(obj)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


class _Messages:
    """Length-prefixed pickles read from a pipe, one ``feed`` at a time."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list:
        self._buf += data
        out = []
        while len(self._buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self._buf)
            if len(self._buf) < _HEADER.size + n:
                break
            out.append(pickle.loads(self._buf[_HEADER.size:_HEADER.size + n]))
            self._buf = self._buf[_HEADER.size + n:]
        return out


# ---- the zygote (this file run as a script) -------------------------------------------------------
def _serve() -> dict:
    """Fork a child per request read on fd 0, report its pid and later its exit status on fd 1.
    Returns (in the child only) the request the child is to run."""
    import select

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    messages = _Messages()
    while True:
        ready, _, _ = select.select([0, wake_r], [], [])
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        _reap()
        if 0 not in ready:
            continue
        data = os.read(0, 1 << 16)
        if not data:  # the test process is gone
            os._exit(0)
        for req in messages.feed(data):
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                return req
            _send(1, ("started", req["id"], pid))


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(1, ("exited", pid, os.waitstatus_to_exitcode(status)))


def _become(req: dict) -> None:
    """In the forked child: become ``python -m req['module'] *req['args']``."""
    import runpy

    os.setsid()
    if req.get("netns"):  # what ``ip netns exec NS`` does for a process that only needs the network
        import ctypes

        fd = os.open(f"/var/run/netns/{req['netns']}", os.O_RDONLY)
        if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns {req['netns']}")
        os.close(fd)
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_APPEND),
                            (2, req["stderr"], os.O_WRONLY | os.O_APPEND)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.path[0] = req["cwd"]  # as ``python -m`` has it (this script's directory was there)
    sys.argv = [req["module"], *req["args"]]
    runpy.run_module(req["module"], run_name="__main__", alter_sys=True)


# ---- the test process's side -----------------------------------------------------------------------
class Forked:
    """A node forked by the zygote, with the part of ``subprocess.Popen``'s interface tests use."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid, self.args = pid, args
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _set_exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """This test process's zygote: started at the first spawn, ended when this process ends."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        # one intra-op thread, as every node the tests start asks (OpenMP reads it when torch loads)
        self._proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      env=dict(env, OMP_NUM_THREADS="1"), cwd=cwd, start_new_session=True)
        self._lock = threading.Lock()
        self._next_id = 0
        self._started: dict[int, int] = {}
        self._started_cv = threading.Condition(self._lock)
        self._procs: dict[int, Forked] = {}
        self._early: dict[int, int] = {}  # exits reported before the spawn that started them returned
        self.alive = True
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def spawn(self, cmd: list[str], stdout: Path, stderr: Path, env: dict[str, str], cwd: Path,
              netns: str | None = None) -> Forked:
        assert cmd[1] == "-m", cmd
        with self._lock:
            self._next_id += 1
            req_id = self._next_id
            _send(self._proc.stdin.fileno(), {"id": req_id, "module": cmd[2], "args": cmd[3:], "stdout": str(stdout),
                                              "stderr": str(stderr), "env": env, "cwd": str(cwd),
                                              "netns": netns})
            if not self._started_cv.wait_for(lambda: req_id in self._started or not self.alive, timeout=30):
                raise RuntimeError("the test zygote did not fork in 30 s")
            if not self.alive:
                raise RuntimeError("the test zygote exited")
            pid = self._started.pop(req_id)
            proc = self._procs[pid] = Forked(pid, cmd)
            if pid in self._early:
                proc._set_exit(self._early.pop(pid))
            return proc

    def _read(self) -> None:
        messages = _Messages()
        fd = self._proc.stdout.fileno()
        while data := os.read(fd, 1 << 16):
            for kind, a, b in messages.feed(data):
                with self._lock:
                    if kind == "started":
                        self._started[a] = b
                        self._started_cv.notify_all()
                    elif (proc := self._procs.pop(a, None)) is not None:
                        proc._set_exit(b)
                    else:
                        self._early[a] = b
        with self._lock:
            self.alive = False
            self._started_cv.notify_all()


_zygote: Zygote | None = None
_zygote_pid = 0


def spawn(cmd: list[str], log: Path, env: dict[str, str], cwd: Path, stderr: Path | None = None,
          netns: str | None = None) -> Forked | None:
    """``cmd`` (``[python, "-m", module, *args]``) forked by this process's zygote, appending its
    output to ``log`` (and its errors to ``stderr`` if given; the caller made both), in network
    namespace ``netns`` if given, or None when
    forking is off (``PDSERVE_TEST_FORK=0``) or the command is not a ``-m`` run of this Python.
    The zygote is started with the first call's environment and ``OMP_NUM_THREADS=1``: its libraries
    read theirs at import, before any child's environment is set."""
    global _zygote, _zygote_pid
    if os.environ.get("PDSERVE_TEST_FORK", "1") == "0" or cmd[:2] != [sys.executable, "-m"]:
        return None
    if _zygote is None or not _zygote.alive or _zygote_pid != os.getpid():
        _zygote, _zygote_pid = Zygote(env, cwd), os.getpid()
    return _zygote.spawn(cmd, log, stderr or log, env, cwd, netns)


def run(cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float | None = None,
        check: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, ...)``, the command forked by the zygote
    when it is a ``-m`` run of this Python (``--help``, a start-up that fails: most of their time was
    imports)."""
    import tempfile

    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        out.touch()
        err.touch()
        proc = spawn(cmd, out, env, cwd, stderr=err)
        if proc is None:
            return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=check)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        done = subprocess.CompletedProcess(cmd, proc.returncode, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    for _name in PRELOAD:
        try:
            __import__(_name)
        except ImportError:
            pass
    _become(_serve())
