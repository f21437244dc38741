"""``python -m decode_node``: a decode daemon of this role only (``pdserve decode``, pdserve/daemon.py, is
the same daemon able to flip to prefill in place; same flags)."""

from __future__ import annotations

from common.node.node import check_ports, parse_config
from common.node.startup import one_line_failures


def main(argv: list[str] | None = None) -> None:
    """Parse the flags and check the ports first, so ``--help``, bad flags and a taken port
    answer before torch is imported."""
    config = parse_config(argv, "decode")
    with one_line_failures("pdserve decode"):
        check_ports(config)  # a taken port answers at once, before seconds of imports
        from decode_node.daemon import serve

        serve(config)


if __name__ == "__main__":
    main()
