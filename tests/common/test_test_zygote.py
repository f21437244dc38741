"""The suite's zygote (tests/helpers/zygote.py) starts what ``python -m`` would have started: these
check what a forked child must not inherit from the zygote, and what its parent must see of it."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from helpers import zygote
from helpers.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def forking():
    if os.environ.get("PDSERVE_TEST_FORK", "1") == "0":
        pytest.skip("PDSERVE_TEST_FORK=0: nodes are started with plain Popen")


def _probe(*args: str, env: dict[str, str] | None = None):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **(env or {})}
    return zygote.run([sys.executable, "-m", "helpers.zygote_probe", *args], cwd=ROOT / "tests", env=env,
                      timeout=60)


def test_a_child_gets_its_own_argv_env_cwd_session_and_output() -> None:
    done = _probe("report", "--flag", "x y", env={"PROBE_VAR": "set by the test"})
    assert done.returncode == 0, done.stderr
    report = dict(line.split("=", 1) for line in done.stdout.splitlines())
    assert report["argv"] == repr(["--flag", "x y"])
    assert report["env"] == "set by the test"
    assert report["cwd"] == str(ROOT / "tests")
    assert report["sid"] == report["pid"] != str(os.getpid())  # a session of its own, like start_new_session
    assert report["main"] == "helpers.zygote_probe"  # run as __main__ from its module, as -m does
    assert report["stdin"] == ""  # stdin is /dev/null
    assert done.stderr == "to stderr\n"


@pytest.mark.parametrize(("how", "code"), [("exit3", 3), ("raise", 1), ("usage", 2)])
def test_a_childs_exit_status_is_what_python_m_gives(how: str, code: int) -> None:
    done = _probe(how)
    assert done.returncode == code
    if how == "raise":
        assert "RuntimeError: the probe failed" in done.stderr


def test_a_signal_ends_a_child_as_it_ends_a_process(tmp_path: Path) -> None:
    log = tmp_path / "probe.log"
    log.touch()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    proc = zygote.spawn([sys.executable, "-m", "helpers.zygote_probe", "wait"], log, env, ROOT / "tests")
    assert proc is not None
    wait_until(lambda: "waiting" in log.read_text(), "the probe runs", 60)
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
