"""``pdserve prefill`` / ``pdserve decode``: a daemon that can flip to the other role in place.

A role package imports no other role (docs/ARCHITECTURE.md, "Processes and packages"), so the daemon
that carries both roles' parts (their connectors and HTTP hooks, common/node/daemon_roles.py) is
assembled here, above both; ``python -m prefill_node`` / ``python -m decode_node`` run a daemon of
their own role only (``POST /admin/role`` to the other role answers 409 ``role_flip_unsupported``).
"""

from __future__ import annotations

from common.node.node import check_ports, parse_config
from common.node.startup import one_line_failures


def main(argv: list[str] | None = None, role: str = "prefill") -> None:
    """Parse the flags and check the ports first (``--help``, bad flags and a taken port answer
    before torch is imported), then serve ``role`` with the other role ready for a flip."""
    config = parse_config(argv, role)
    with one_line_failures(f"pdserve {role}"):
        check_ports(config)
        from common.node.daemon_roles import serve_daemon
        from decode_node.daemon import DecodeRole
        from prefill_node.daemon import PrefillRole

        serve_daemon(config, {"prefill": PrefillRole(config), "decode": DecodeRole()})
