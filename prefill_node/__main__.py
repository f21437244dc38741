"""``python -m prefill_node`` / ``pdserve prefill``: a prefill daemon (same flags)."""

from __future__ import annotations

from prefill_node.daemon import main

if __name__ == "__main__":
    main()
