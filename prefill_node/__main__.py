"""``python -m prefill_node`` / ``pdserve prefill``: a prefill daemon (same flags)."""

from __future__ import annotations

from common.node import main as node_main


def main(argv: list[str] | None = None) -> None:
    node_main(argv, role="prefill")


if __name__ == "__main__":
    main()
