"""``--cache-salt-from-api-key``: each client's API key becomes its own prefix-cache tenant.

Requests share cached KV blocks only when their ``cache_salt`` is equal (the engine mixes it
into the first block's hash). Left to clients, a tenant can send no salt, or guess another's,
and learn from time-to-first-token whether someone sent a prompt. With this option the proxy
sets every request's ``cache_salt`` itself, overriding whatever the client sent, to
HMAC(secret, the bearer token of its ``Authorization`` header): the same key always shares
its own cache, two keys never do, and the salt reveals nothing of the key (nodes log and see
only the salt). Requests without a bearer token form one tenant of their own.

The secret is the cluster key when there is one (so every proxy of a cluster derives the same
salt and a tenant keeps its cache across proxies and restarts), else random per process.
"""

from __future__ import annotations

import secrets

from common.cluster_auth import ClusterKey
from proxy.api_key import bearer_token

_PURPOSE = b"pdserve cache salt v1"


class TenantSalt:
    """Derives a request's ``cache_salt`` from its ``Authorization`` header."""

    def __init__(self, key: ClusterKey | None = None) -> None:
        self._key = key or ClusterKey(secrets.token_bytes(32))

    def salt(self, authorization: str | None) -> str:
        """64 hex characters naming the tenant of this header (no token: the anonymous tenant)."""
        token = bearer_token(authorization.encode("latin-1", "replace")) if authorization else None
        return self._key.mac(_PURPOSE, token or b"").hex()

    def apply(self, body: dict, authorization: str | None) -> dict:
        """``body`` with its ``cache_salt`` set to the tenant's (a client's own is overridden)."""
        return {**body, "cache_salt": self.salt(authorization)}
