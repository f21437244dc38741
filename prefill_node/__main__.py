"""``python -m prefill_node`` / ``pdserve prefill``: a prefill daemon (same flags)."""

from __future__ import annotations

from pdserve.node import parse_config
from pdserve.startup import one_line_failures


def main(argv: list[str] | None = None) -> None:
    """Parse the flags first, so ``--help`` and bad flags answer before torch is imported."""
    config = parse_config(argv, "prefill")
    from prefill_node.daemon import serve

    with one_line_failures("pdserve prefill"):
        serve(config)


if __name__ == "__main__":
    main()
