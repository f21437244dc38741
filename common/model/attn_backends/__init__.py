"""Attention backends (see ``common.model.attention`` for the interface and the choice)."""
