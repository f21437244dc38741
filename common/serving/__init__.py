"""The OpenAI-compatible serving layer every node role uses (``build_app``)."""
