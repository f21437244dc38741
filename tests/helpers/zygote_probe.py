"""A stand-in for a node, for tests/common/test_test_zygote.py: says what it was given, or exits as asked."""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    what = sys.argv[1]
    if what == "report":
        print(f"argv={sys.argv[2:]!r}")
        print(f"env={os.environ.get('PROBE_VAR', '')}")
        print(f"cwd={os.getcwd()}")
        print(f"pid={os.getpid()}")
        print(f"sid={os.getsid(0)}")
        print(f"main={sys.modules['__main__'].__spec__.name}")
        print(f"stdin={sys.stdin.read()}")
        print("to stderr", file=sys.stderr)
    elif what == "exit3":
        sys.exit(3)
    elif what == "raise":
        raise RuntimeError("the probe failed")
    elif what == "usage":
        import argparse

        argparse.ArgumentParser().parse_args(["--no-such-flag"])
    elif what == "wait":
        print("waiting", flush=True)
        time.sleep(120)


if __name__ == "__main__":
    main()
