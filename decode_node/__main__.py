"""``python -m decode_node`` / ``pdserve decode``: a decode daemon (same flags)."""

from __future__ import annotations

from decode_node.daemon import main

if __name__ == "__main__":
    main()
