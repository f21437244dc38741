"""One ``pdserve serve`` process for a test: started, awaited on /ready, stopped cleanly."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from helpers.cluster import Proc
from helpers.ports import free_port  # noqa: F401  (test_cli_pdserve imports it from here)


@contextmanager
def serving(argv: list[str], port: int, log: Path, *, cwd: Path, env: Mapping[str, str] | None = None,
            ready_timeout: float = 180.0) -> Iterator[str]:
    """Run ``argv`` (a serve command listening on ``port``) until the block ends; yields its URL.

    Fails with the log if it exits or is not ready in time, and if SIGTERM does not end it
    with status 0 (a graceful stop)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    served = Proc("serve", proc, port, log)
    try:
        served.wait_ready(ready_timeout)
        yield served.url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()
