"""``pdserve``: one console script, a subcommand per process.

    pdserve serve|prefill|decode|proxy [flags]   one process (see ``pdserve <cmd> --help``)
    pdserve up|down                              the three on loopback, and stop them
    pdserve --version                            the installed version

``pdserve`` with no command prints the usage and exits 2 (a usage error), as argparse does.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

# command -> (module, what it starts); each module's ``main(argv)`` parses its own flags.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("common.node.node", "a colocated node (prefill and decode in one process): the baseline"),
    "prefill": ("pdserve.daemon", "a prefill daemon (flips to decode in place: POST /admin/role)"),
    "decode": ("pdserve.daemon", "a decode daemon (flips to prefill in place: POST /admin/role)"),
    "proxy": ("proxy.__main__", "the proxy: OpenAI front, registry, P/D pairing"),
    "up": ("pdserve.launcher_cli", "proxy + prefill + decode on loopback with the default model"),
    "down": ("pdserve.launcher_cli", "stop what 'pdserve up' started"),
}


def usage() -> str:
    lines = ["usage: pdserve <command> [flags]   (pdserve <command> --help for its flags; pdserve --version)",
             "", "commands:"]
    lines += [f"  {name:<9} {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines) + "\n"


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's, through the package metadata)."""
    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "unknown (not installed; pip install -e .)"


def _entry(command: str) -> Callable[[list[str]], int | None]:
    module_name = COMMANDS[command][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module_name.startswith(exc.name):
            raise  # a dependency of the module is missing: show the real error
        sys.exit(f"pdserve {command}: not available in this build ({module_name} is missing)")
    if command == "serve":
        return lambda rest: module.main(rest, role="both")
    if module_name == "pdserve.daemon":
        return lambda rest: module.main(rest, role=command)
    if module_name == "pdserve.launcher_cli":
        return lambda rest: module.main([command, *rest])
    return module.main


def main(argv: list[str] | None = None) -> None:
    """Dispatch ``pdserve <command> [flags]``; a command's integer result is the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        sys.stderr.write(usage())
        sys.exit(2)
    if argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(usage())
        return
    if argv[0] in ("-V", "--version"):
        sys.stdout.write(f"pdserve {package_version()}\n")
        return
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        sys.stderr.write(f"pdserve: error: unknown command '{command}' (choose from {', '.join(COMMANDS)})\n")
        sys.exit(2)
    code = _entry(command)(rest)
    if isinstance(code, int) and code:
        sys.exit(code)


if __name__ == "__main__":
    main()
