"""One default SSL context for every httpx client the tests build.

``httpx.get`` / ``httpx.post`` build a client per call, and each client an SSL context that loads
certifi's CA bundle: ~15 ms of CPU a call, though every URL the tests ask is ``http://``. In the
request-heavy files that was most of the test process's CPU (test_fidelity_e2e + test_bad_input_matrix
alone on the VM: 26.0 s of the test process's CPU and 38.8 s wall, then 2.2 s and 16.4 s). An SSL
context may serve any number of clients (httpx's docs pass one to many), so the default one is built
once; a client that asks for anything else (``verify=False``, a CA file, a client cert) gets its own.
"""

from __future__ import annotations

import functools
import os
import ssl


def share_default_ssl_context() -> None:
    """Make httpx's transports reuse one default context (httpx's own function, called once per
    SSL_CERT_FILE / SSL_CERT_DIR). httpx keeps the function private: if it is gone, nothing changes."""
    from httpx._transports import default as transports

    create = getattr(transports, "create_ssl_context", None)
    if create is None or getattr(create, "shared", False):
        return

    @functools.cache
    def default_context(cafile: str | None, capath: str | None) -> ssl.SSLContext:
        return create()

    def create_ssl_context(verify: object = True, cert: object = None, trust_env: bool = True) -> ssl.SSLContext:
        if verify is True and cert is None and trust_env:
            return default_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        return create(verify=verify, cert=cert, trust_env=trust_env)

    create_ssl_context.shared = True  # type: ignore[attr-defined]
    transports.create_ssl_context = create_ssl_context
